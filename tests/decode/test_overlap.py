"""The host transfer and the queued step: kept, it is the step; given back, it leaves no trace."""

import pytest
import torch

from continuous.decode.overlap import Queued, to_host
from continuous.decode.prefill import top_up
from continuous.layout import Rows


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA"))])
def test_to_host_gives_the_values_of_each_tensor(device):
    ids, weights = torch.tensor([[1, 2], [3, 4]], device=device), torch.tensor([0.5, -1.25], device=device)
    read = to_host(ids, weights)
    ids.add_(10)  # written after the copy was queued: the read keeps what was copied
    assert read() == [[[1, 2], [3, 4]], [0.5, -1.25]]


def _prefilled(model):
    return top_up(model, Rows.from_texts(model.tokenizer, ["Alice lives in", "Bob has a"]))


def test_a_queued_step_taken_is_the_plain_forward(model):
    rows = _prefilled(model)
    ids = rows.logits.argmax(-1)
    plain_logits, plain_cache = model.forward(ids[:, None], None, rows.cache)
    queued = Queued(model, ids, rows.cache)
    logits, cache = queued.take()
    assert torch.allclose(logits, plain_logits[:, -1], atol=1e-5)
    assert cache.length == plain_cache.length == rows.cache.length + 1


def test_a_queued_step_given_back_frees_its_slots_and_counts_as_rewound(model):
    rows = _prefilled(model)
    ids = rows.logits.argmax(-1)
    rewound = model.stats.tokens_rewound
    Queued(model, ids, rows.cache).give_back()
    assert model.stats.tokens_rewound == rewound + 2
    # The prompt's view is the buffer's tip again: the next forward appends in place.
    _, cache = model.forward(ids[:, None], None, rows.cache)
    assert cache._buffer is rows.cache._buffer
    Queued(model, ids, cache).give_back(count=False)
    assert model.stats.tokens_rewound == rewound + 2
