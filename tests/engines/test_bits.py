"""Packed token masks: one bit per token, written on the host, unpacked on the device."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from continuous.engines import bits

N_TOKENS = 100

allowed_sets = st.one_of(st.just(set()), st.sets(st.integers(0, N_TOKENS - 1), min_size=1, max_size=3),
                         st.sets(st.integers(0, N_TOKENS - 1), max_size=N_TOKENS))


def _packed(ids: set[int]) -> torch.Tensor:
    row = torch.zeros(bits.words(N_TOKENS), dtype=torch.int32)
    bits.pack(ids, row, N_TOKENS)
    return row


@settings(max_examples=100, deadline=None)
@given(st.lists(allowed_sets, min_size=1, max_size=8))
def test_rows_unpack_to_their_tokens_and_a_lone_token_is_found_in_each_row(sets):
    rows = torch.stack([_packed(ids) for ids in sets])
    allowed = bits.unpack(rows, N_TOKENS)
    assert allowed.shape == (len(sets), N_TOKENS) and allowed.dtype == torch.bool
    assert [set(torch.nonzero(row).flatten().tolist()) for row in allowed] == sets
    assert torch.equal(bits._unpack_on_device(rows, N_TOKENS), allowed)  # a GPU's way, run here
    bias = bits.bias(rows, N_TOKENS)
    assert bias.shape == allowed.shape and torch.equal(bias == 0, allowed)
    assert bool(torch.isneginf(bias[~allowed]).all())
    assert torch.equal(bits._bias_on_device(rows, N_TOKENS), bias)
    lone = [next(iter(ids)) if len(ids) == 1 else None for ids in sets]
    assert [bits.only(row) for row in rows] == lone
    assert bits.only_rows(rows) == lone  # all rows at once, as each alone


def test_the_sign_bit_is_a_token_like_any_other():
    row = _packed({31, 63})
    assert bits.has(row, 31) and bits.has(row, 63) and not bits.has(row, 30)
    assert bits.only_rows(torch.stack([_packed({63}), row])) == [63, None]
    bits.clear(row, 63)
    assert bits.only(row) == 31
