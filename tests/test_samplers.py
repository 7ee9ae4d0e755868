"""Samplers return (next ids, ancestors, weights) and respect masks."""

from unittest.mock import patch

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from continuous import samplers


def logits(rows=4, vocab=50, seed=0):
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy():
    lg = logits()
    ids, anc, w = samplers.greedy()(lg, torch.zeros(4))
    assert torch.equal(ids, lg.argmax(-1)) and torch.equal(anc, torch.arange(4))
    assert torch.allclose(w, torch.log_softmax(lg, -1).max(-1).values)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.lists(st.sampled_from([-float("inf"), -1.0, 0.0, 2.0]), min_size=5, max_size=5), min_size=1,
                max_size=4))
def test_greedy_takes_the_first_of_tied_likeliest_tokens_and_its_log_probability(rows):
    """Ties (and rows with nothing allowed) go to the first likeliest token, as ``argmax`` picks;
    its weight gains exactly that token's log-probability."""
    lg = torch.tensor(rows)
    ids, _, w = samplers.greedy()(lg, torch.ones(len(rows)))
    assert ids.tolist() == lg.argmax(-1).tolist()
    logprobs = torch.log_softmax(lg, -1)
    want = 1 + logprobs.gather(1, ids[:, None]).squeeze(1)
    assert torch.equal(w.isnan(), want.isnan()) and torch.equal(w[~w.isnan()], want[~want.isnan()])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.one_of(st.just(-float("inf")), st.floats(-699.0, 30.0)), min_size=6, max_size=6),
                min_size=1, max_size=4), st.integers(0, 2**32))
def test_a_sample_is_the_inverse_cdf_token_of_its_draw_and_never_a_forbidden_one(rows, seed):
    """The token a draw picks is the first whose cumulative probability exceeds it, computed in
    float64 from ``exp`` of each log-probability; forbidden tokens (``-inf``) are never picked."""
    logprobs = torch.log_softmax(torch.tensor(rows), -1)
    ids, _, w = samplers._sample(logprobs, torch.zeros(len(rows)), torch.Generator().manual_seed(seed))
    u = torch.rand(len(rows), 1, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    cdf = logprobs.double().exp().cumsum(-1)
    want = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1).clamp(max=len(rows[0]) - 1)
    assert ids.tolist() == want.tolist()
    allowed = [any(v > -float("inf") for v in row) for row in rows]
    assert all(not ok or logprobs[r, ids[r]] > -float("inf") for r, ok in enumerate(allowed))
    assert torch.equal(w[torch.tensor(allowed)], logprobs.gather(1, ids[:, None]).squeeze(1)[torch.tensor(allowed)])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.one_of(st.just(-float("inf")), st.floats(-1e30, 1e30)), st.booleans()), min_size=1,
                max_size=40), st.sampled_from([torch.float32, torch.float64]))
def test_forbidding_tokens_gives_masked_fill_s_logits(cells, dtype):
    lg = torch.tensor([v for v, _ in cells], dtype=dtype)[None]
    drop = torch.tensor([d for _, d in cells])[None]
    assert torch.equal(samplers._forbid(lg, drop), lg.masked_fill(drop, -torch.inf))


def _top_p_by_full_sort(logits, top_p):
    values, order = torch.sort(logits, descending=True, dim=-1)
    probs = torch.softmax(values, -1)
    drop_sorted = (probs.cumsum(-1) - probs) >= top_p
    return torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)


@settings(max_examples=80, deadline=None)
# Distinct in float32: tied logits may be kept in either order.
@given(st.lists(st.lists(st.floats(-20, 20, width=32), min_size=40, max_size=40, unique=True), min_size=1, max_size=4),
       st.lists(st.sampled_from([0.1, 0.5, 0.9, 0.99, 2.0]), min_size=4, max_size=4), st.booleans())
def test_top_p_drops_what_a_sort_of_every_token_drops(rows, per_row, scalar):
    """Top-p looks at each row's likeliest few first (here 4, then 16, then all 40): it drops the
    same tokens as a sort of every token, for one top-p or one per row (2: no top-p for that row)."""
    logits = torch.tensor(rows)
    top_p = per_row[0] if scalar and per_row[0] < 1 else torch.tensor(per_row[: len(rows)])[:, None]
    # A mass within rounding of top-p is dropped or kept by how the probabilities were summed (the
    # head's are exp(logit - logsumexp), the reference's a softmax of the sorted row): not compared.
    probs = torch.softmax(torch.sort(logits, descending=True).values, -1)
    assume(not bool(((probs.cumsum(-1) - probs - top_p).abs() < 1e-5).any()))
    with patch.object(samplers, "_HEADS", (4, 16)):
        assert torch.equal(samplers._past_top_p(logits, top_p), _top_p_by_full_sort(logits, top_p))


def test_multinomial_respects_mask_top_k_top_p():
    lg = logits()
    lg[:, 10:] = -torch.inf
    rng = torch.Generator().manual_seed(0)
    for _ in range(20):
        ids, _, _ = samplers.multinomial(top_k=3)(lg, torch.zeros(4), rng)
        top3 = torch.topk(lg, 3).indices
        assert all(ids[r] in top3[r] for r in range(4))
    top1 = samplers.multinomial(top_k=1)(lg, torch.zeros(4), rng)[0]
    assert torch.equal(top1, lg.argmax(-1))
    tiny_p = samplers.multinomial(top_p=1e-6)(lg, torch.zeros(4), rng)[0]
    assert torch.equal(tiny_p, lg.argmax(-1))  # the most likely token always survives top_p
    processed = samplers.multinomial(top_p=0.5).process(lg)
    probs = torch.softmax(lg, -1)
    for r in range(4):
        kept = probs[r][processed[r] > -torch.inf]
        assert kept.sum() >= 0.5 and (kept.sum() - kept.min()) < 0.5


def test_multinomial_weights_use_the_processed_distribution():
    lg = logits(rows=2)
    sampler = samplers.multinomial(temperature=0.5)
    ids, _, w = sampler(lg, torch.tensor([1.0, 2.0]), torch.Generator().manual_seed(1))
    expected = torch.log_softmax(lg / 0.5, -1).gather(1, ids[:, None]).squeeze(1) + torch.tensor([1.0, 2.0])
    assert torch.allclose(w, expected)


def test_beam_search_keeps_the_best_rows_per_prompt():
    lg = logits(rows=4, vocab=5)
    weights = torch.tensor([0.0, -1.0, -0.5, -0.2])
    ids, anc, w = samplers.beam_search(2)(lg, weights)
    scores = weights[:, None] + torch.log_softmax(lg, -1)
    for b in range(2):
        group = scores[2 * b: 2 * b + 2].flatten()
        best = torch.topk(group, 2)
        assert torch.allclose(w[2 * b: 2 * b + 2], best.values)
        assert anc[2 * b: 2 * b + 2].tolist() == [2 * b + int(i) // 5 for i in best.indices]
        assert ids[2 * b: 2 * b + 2].tolist() == [int(i) % 5 for i in best.indices]


def test_bad_parameters():
    with pytest.raises(ValueError):
        samplers.multinomial(0)
    with pytest.raises(ValueError):
        samplers.multinomial(temperature=0)
    with pytest.raises(ValueError):
        samplers.multinomial(top_p=1.5)
    with pytest.raises(ValueError):
        samplers.beam_search(0)


@pytest.mark.parametrize("kwargs, error", [
    (dict(temperature=float("nan")), ValueError),
    (dict(temperature=float("inf")), ValueError),
    (dict(temperature="hot"), TypeError),
    (dict(top_k=2.5), TypeError),
    (dict(top_k=True), TypeError),
    (dict(top_p=float("nan")), ValueError),
    (dict(samples=2.0), TypeError),
    (dict(samples="2"), TypeError),
])
def test_bad_parameters_fail_when_built(kwargs, error):
    # Each was once accepted, then failed inside torch (or not at all).
    with pytest.raises(error, match=next(iter(kwargs))):
        samplers.multinomial(**kwargs)


@pytest.mark.parametrize("beams", [2.0, "2", None])
def test_bad_beams_fail_when_built(beams):
    with pytest.raises(TypeError, match="beams"):
        samplers.beam_search(beams)


@pytest.mark.parametrize("seed, error", [(2**64, ValueError), (-(2**63) - 1, ValueError),
                                         (1.5, TypeError), ("3", TypeError), (True, TypeError)])
def test_check_seed_refuses_what_torch_cannot_take(seed, error):
    with pytest.raises(error, match="seed"):
        samplers.check_seed(seed)


@pytest.mark.parametrize("seed", [None, 0, 2**64 - 1, -(2**63)])
def test_check_seed_accepts_what_torch_takes(seed):
    assert samplers.check_seed(seed) == seed
    if seed is not None:
        torch.Generator().manual_seed(seed)  # the bounds are torch's own


_params = st.fixed_dictionaries({}, optional={
    "temperature": st.sampled_from([0.3, 0.7, 1.0, 1.6]), "top_k": st.integers(1, 60),
    "top_p": st.sampled_from([1e-6, 0.3, 0.9, 1.0]), "min_p": st.sampled_from([0.0, 0.05, 0.5, 1.0])})


@settings(max_examples=60, deadline=None)
@given(calls=st.lists(st.tuples(_params, st.integers(1, 3)), min_size=1, max_size=4), seed=st.integers(0, 2**31))
def test_one_pass_over_several_calls_rows_draws_each_row_as_its_call_alone(calls, seed):
    """Samplers with different parameters, run as one pass with per-row columns: each row's
    token and weight are those its call's sampler gives it alone, from the same stream."""
    chosen = [samplers.multinomial(**params) for params, _ in calls]
    counts = [n for _, n in calls]
    lg = logits(sum(counts), vocab=50, seed=seed % 1000)
    lg[:, 40:] = -torch.inf  # masked tokens, as a constraint leaves them
    weights = torch.randn(sum(counts), generator=torch.Generator().manual_seed(seed))
    streams = [samplers.RowDraws(n, torch.Generator().manual_seed(seed + i)) for i, n in enumerate(counts)]
    again = [samplers.RowDraws(n, torch.Generator().manual_seed(seed + i)) for i, n in enumerate(counts)]
    ids, _, w = samplers.choose(chosen, counts, lg, weights, samplers.RowDraws.joined(streams))
    at = 0
    for sampler, n, rng in zip(chosen, counts, again):
        alone_ids, _, alone_w = sampler(lg[at : at + n], weights[at : at + n], rng)
        assert torch.equal(ids[at : at + n], alone_ids)
        assert torch.equal(w[at : at + n], alone_w)
        at += n
