"""Invariant checks shared by the test modules: continuing a state equals recomputing it."""

import torch

from continuous.decode import top_up


def greedy_tokens(gen, state, n=6):
    """Tokens a greedy continuation adds to each row."""
    out = gen(state, max_tokens=n)
    return [out._rows.real_ids(r)[len(state._rows.real_ids(r)):] for r in range(out._rows.n_rows)]


def assert_equivalent(gen, state, n=6):
    """Continuing a state equals continuing it after drop_cache (tokens and next logits)."""
    fresh = state.drop_cache()
    logits = top_up(state.model, state._rows).logits
    ref = top_up(state.model, fresh._rows).logits
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)
    assert greedy_tokens(gen, state, n) == greedy_tokens(gen, fresh, n)
    assert list(gen(state, max_tokens=n)) == list(gen(fresh, max_tokens=n))
