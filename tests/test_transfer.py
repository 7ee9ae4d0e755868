"""Host <-> device transfers: the values arrive, and later writes do not reach what was copied."""

import pytest
import torch

from continuous.transfer import to_device, to_host

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
