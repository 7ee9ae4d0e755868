"""Comparing states in tests: their real token ids, and sameness in the strongest form.

:func:`assert_equivalent` is the check that a state's cache holds what its tokens say:
continuing it gives the same next logits, greedy tokens and values as continuing the same
tokens recomputed from scratch (``drop_cache()``).
"""

from __future__ import annotations

import pytest
import torch

from continuous.decode import top_up


def real_ids(state, row: int = 0) -> list[int]:
    """A row's token ids, padding and holes left out."""
    return state.token_ids[row][state.attention_mask[row].bool()].tolist()


def all_real_ids(state) -> list[list[int]]:
    """Every row's token ids, padding and holes left out."""
    return [real_ids(state, r) for r in range(state.token_ids.shape[0])]


def same_as_alone(a, b) -> None:
    """``b``, a call's state made beside other calls, is ``a``, the same call's alone: the same
    values, finish reasons, weights (within 1e-3), each row's tokens (holes aside: a call of a
    table keeps no slot that its rewinds took back, where the call alone keeps them as holes)
    and log-probabilities (within 1e-3). Weights and log-probabilities are compared within a
    tolerance because a batch of another size sums in another order."""
    assert list(a) == list(b)
    assert a.finish_reasons == b.finish_reasons
    assert torch.allclose(a.weights, b.weights, atol=1e-3)
    assert all_real_ids(a) == all_real_ids(b)
    if a.logprobs is not None:
        for ra, rb in zip(a.logprobs, b.logprobs):
            assert [t for t, _, _ in ra] == [t for t, _, _ in rb]
            assert [lp for _, lp, _ in ra] == pytest.approx([lp for _, lp, _ in rb], abs=1e-3)


def greedy_tokens(gen, state, n: int = 6) -> list[list[int]]:
    """The tokens a greedy continuation of ``n`` tokens adds to each row."""
    out = gen(state, max_tokens=n)
    return [new[len(old):] for old, new in zip(all_real_ids(state), all_real_ids(out))]


def assert_equivalent(gen, state, n: int = 6, tol: float = 1e-4) -> None:
    """Continuing ``state`` equals continuing it after ``drop_cache()``: its next logits (within
    ``tol``), the greedy tokens and the values of ``gen`` run for ``n`` tokens."""
    fresh = state.drop_cache()
    logits = top_up(state.model, state._rows).logits
    ref = top_up(state.model, fresh._rows).logits
    torch.testing.assert_close(logits, ref, atol=tol, rtol=tol)
    assert greedy_tokens(gen, state, n) == greedy_tokens(gen, fresh, n)
    assert list(gen(state, max_tokens=n)) == list(gen(fresh, max_tokens=n))
