"""Host <-> device transfers: the values arrive, and later writes do not reach what was copied."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from continuous.transfer import VIEW_BYTES, cat_rows, owned, split_rows, to_device, to_host

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


@pytest.mark.parametrize("device", DEVICES)
def test_to_host_gives_the_values_of_each_tensor(device):
    ids, weights = torch.tensor([[1, 2], [3, 4]], device=device), torch.tensor([0.5, -1.25], device=device)
    read = to_host(ids, weights)
    ids.add_(10)  # written after the copy was queued: the read keeps what was copied
    assert read() == [[[1, 2], [3, 4]], [0.5, -1.25]]


@pytest.mark.parametrize("device", DEVICES)
def test_to_device_takes_lists_and_host_tensors(device):
    device = torch.device(device)
    rows = to_device([[1, 0], [0, 1]], device, torch.bool)
    assert rows.device.type == device.type and rows.dtype == torch.bool
    assert rows.tolist() == [[True, False], [False, True]]
    assert to_device(torch.arange(4), device, torch.float32).tolist() == [0.0, 1.0, 2.0, 3.0]
    on_device = torch.ones(2, device=device)
    assert to_device(on_device, device) is on_device  # already there: nothing is copied


@given(st.lists(st.integers(1, 3), min_size=1, max_size=6), st.data())
def test_cat_rows_equals_cat_and_copies_nothing_only_for_consecutive_blocks_of_one_tensor(sizes, data):
    """What a split handed out, given back: a view when the blocks are consecutive and in order,
    a copy otherwise (some left out, reordered, or not of one tensor); also for a tensor made in
    inference mode (as a model's logits are), whose views know no base."""
    width = VIEW_BYTES // 8  # a row of longs as large as the smallest rows viewed
    with torch.inference_mode(data.draw(st.booleans())):
        whole = torch.arange(sum(sizes) * width).view(-1, width)
    blocks = list(whole.split(sizes))
    picked = data.draw(st.lists(st.integers(0, len(blocks) - 1), min_size=1, max_size=len(blocks)))
    if data.draw(st.booleans()):
        picked.append(-1)  # a tensor of its own among them
    parts = [blocks[i] if i >= 0 else torch.zeros((1, width), dtype=whole.dtype) for i in picked]
    joined = cat_rows(parts)
    assert torch.equal(joined, torch.cat(parts))
    consecutive = len(parts) == 1 or (-1 not in picked and picked == list(range(picked[0], picked[0] + len(picked))))
    assert (joined.data_ptr() == parts[0].data_ptr()) == consecutive


@given(st.lists(st.integers(1, 3), min_size=2, max_size=6), st.data())
def test_blocks_of_split_rows_give_back_their_tensor_with_nothing_copied_only_when_consecutive(sizes, data):
    whole = torch.arange(sum(sizes) * 2).view(-1, 2)  # small: no address would be checked
    blocks = split_rows(whole, sizes)
    assert [len(b) for b in blocks] == sizes and torch.equal(torch.cat(blocks), whole)
    picked = data.draw(st.lists(st.integers(0, len(blocks) - 1), min_size=2, max_size=len(blocks)))
    if data.draw(st.booleans()):
        picked.append(-1)  # a block of another split of the same sizes
    other = split_rows(whole.clone(), sizes)
    parts = [blocks[i] if i >= 0 else other[0] for i in picked]
    joined = cat_rows(parts)
    assert torch.equal(joined, torch.cat(parts))
    consecutive = -1 not in picked and picked == list(range(picked[0], picked[0] + len(picked)))
    assert (joined.data_ptr() == parts[0].data_ptr()) == consecutive
    if picked == list(range(len(blocks))):
        assert joined is whole


def test_cat_rows_copies_small_rows_and_tensors_that_only_follow_each_other_in_memory():
    whole = torch.arange(8).view(4, 2)
    small = cat_rows(list(whole.split(1)))
    assert torch.equal(small, whole) and small.data_ptr() != whole.data_ptr()
    width = VIEW_BYTES // 4
    memory = bytearray(8 * width)
    first, second = (torch.frombuffer(memory, dtype=torch.float32, count=width, offset=at).view(1, width)
                     for at in (0, 4 * width))
    assert second.data_ptr() == first.data_ptr() + 4 * width  # where a view of the first would read
    second.fill_(1.0)
    joined = cat_rows([first, second])
    assert joined[:, 0].tolist() == [0.0, 1.0] and joined.data_ptr() != first.data_ptr()


def test_cat_rows_of_blocks_torch_cat_refuses_raises_as_torch_cat_does():
    whole = torch.arange(6 * VIEW_BYTES // 8).view(6, -1)
    narrow = whole[2:4, :1]  # one tensor's rows right after the first block, one column only
    with pytest.raises(RuntimeError):
        cat_rows([whole[:2], narrow])


def test_owned_copies_only_a_view_into_more_memory_than_its_own():
    step = torch.arange(12.0).reshape(4, 3)
    row = step[1:2]
    mine = owned(row)
    assert torch.equal(mine, row) and mine.untyped_storage().nbytes() == mine.nelement() * mine.element_size()
    assert owned(step) is step and owned(None) is None
    ones = torch.ones(1).expand(5)  # less memory than elements: nothing of another's in it
    assert owned(ones) is ones
