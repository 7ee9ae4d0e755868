"""The host transfer and the queued step: kept, it is the step; given back, it leaves no trace."""

import torch

from continuous.decode.overlap import Queued
from continuous.decode.prefill import top_up
from continuous.layout import Rows


def _prefilled(model):
    return top_up(model, Rows.from_texts(model.tokenizer, ["Alice lives in", "Bob has a"]))


def test_a_queued_step_taken_is_the_plain_forward(model):
    rows = _prefilled(model)
    ids = rows.logits.argmax(-1)
    plain_logits, plain_cache = model.forward(ids[:, None], None, rows.cache)
    queued = Queued(model, ids[:, None], rows.cache)
    logits, cache = queued.take()
    assert torch.allclose(logits, plain_logits[:, -1], atol=1e-5)
    assert cache.length == plain_cache.length == rows.cache.length + 1


def test_a_queued_step_given_back_frees_its_slots_and_counts_as_rewound(model):
    rows = _prefilled(model)
    ids = rows.logits.argmax(-1)
    rewound = model.stats.tokens_rewound
    Queued(model, ids[:, None], rows.cache).give_back()
    assert model.stats.tokens_rewound == rewound + 2
    # The prompt's view is the buffer's tip again: the next forward appends in place.
    _, cache = model.forward(ids[:, None], None, rows.cache)
    assert cache._buffer is rows.cache._buffer
    Queued(model, ids[:, None], cache).give_back(count=False)
    assert model.stats.tokens_rewound == rewound + 2
