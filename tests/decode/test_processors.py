"""The logits processors: constraint, bans, finished rows and beam ranking shape the scores."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from continuous.decode.constraints import RowConstraints
from continuous.decode.processors import (
    Banned,
    Biased,
    Constrained,
    Finished,
    ForkRanking,
    Penalized,
    Scores,
    _logsumexp,
    run,
)
from continuous.decode.finish import Finish
from continuous.decode.rows import RowState, RowView
from continuous.engines import regex


def _rows(tokenizer, n, finished=()):
    return [RowView(r in finished, None, {}, (tokenizer.bos_token_id,), []) for r in range(n)]


def _scores(tokenizer, n=2, vocab=None, step=0):
    vocab = vocab or len(tokenizer)
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(0))
    return Scores(logits, torch.tensor([-1.0, -2.0, -3.0, -4.0][:n]), step, _rows(tokenizer, n))


def test_the_constraint_forbids_what_it_does_not_allow(tokenizer):
    constraint = regex("[0-9]", tokenizer)
    scores = _scores(tokenizer)
    before = scores.logits.clone()
    Constrained(RowConstraints(constraint, 2, len(tokenizer), len(tokenizer), tokenizer.eos_token_id,
                               torch.device("cpu")))(scores)
    digits = {tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)}
    allowed = torch.isfinite(scores.logits)
    assert {int(t) for t in allowed[0].nonzero()} == digits
    assert torch.equal(scores.logits[allowed], before[allowed])  # allowed scores unchanged
    assert torch.equal(before, _scores(tokenizer).logits)  # the input tensor is not written


def test_free_text_never_emits_ids_past_the_tokenizer(tokenizer):
    scores = _scores(tokenizer, vocab=len(tokenizer) + 24)  # padded embeddings
    Constrained(RowConstraints(None, 2, len(tokenizer) + 24, len(tokenizer), tokenizer.eos_token_id,
                               torch.device("cpu")))(scores)
    assert torch.isinf(scores.logits[:, len(tokenizer):]).all()
    assert torch.isfinite(scores.logits[:, : len(tokenizer)]).all()


def test_bans_at_a_rows_position_forbid_or_down_weight():
    rows = [RowView(False, None, {1: 0.0, 2: 0.5}, (0,), []), RowView(False, None, {}, (0,), [])]
    scores = Scores(torch.zeros(2, 5), torch.zeros(2), 0, rows)
    before = scores.logits
    Banned()(scores)
    assert scores.logits[0, 1] == -math.inf and math.isclose(float(scores.logits[0, 2]), math.log(0.5), rel_tol=1e-6)
    assert torch.equal(scores.logits[1], torch.zeros(5))  # nothing is banned where it is
    assert torch.equal(before, torch.zeros(2, 5))


def test_a_row_view_holds_the_bans_of_its_current_position_only(tokenizer):
    row = RowState.of(tokenizer, [tokenizer.bos_token_id], "", (0,))
    row.history.bans = {0: {1: 0.0}, 3: {4: 0.0}}
    assert row.view().banned == {1: 0.0}
    row.finish(Finish.LENGTH)
    assert row.view().banned == {} and row.view().finished


def test_a_finished_row_only_emits_the_sentinel_at_no_cost(tokenizer):
    scores = _scores(tokenizer)
    scores.views = _rows(tokenizer, 2, finished={1})
    before = scores.logits.clone()
    Finished(sentinel=7)(scores)
    assert torch.equal(scores.logits[0], before[0])
    assert scores.logits[1, 7] == 0 and torch.isinf(scores.logits[1]).sum() == scores.logits.shape[1] - 1
    assert torch.log_softmax(scores.logits[1], -1)[7] == 0  # its weight does not change


def test_forked_rows_are_ranked_by_their_first_only_at_the_first_step(tokenizer):
    scores = _scores(tokenizer, n=4)
    ForkRanking(2)(scores)
    assert scores.rank.tolist() == [-1.0, -math.inf, -3.0, -math.inf]
    later = _scores(tokenizer, n=4, step=1)
    ForkRanking(2)(later)
    assert later.rank.tolist() == [-1.0, -2.0, -3.0, -4.0]


def test_processors_run_in_order(tokenizer):
    calls = []
    given = _scores(tokenizer)
    scores = run([lambda s: calls.append(1), lambda s: calls.append(2)], given.logits, given.rank, 0, given.views)
    assert calls == [1, 2] and isinstance(scores, Scores)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.integers(0, 7), max_size=12), min_size=1, max_size=4),
       st.floats(-2, 2), st.floats(-2, 2), st.sampled_from([torch.float32, torch.bfloat16]))
def test_penalties_subtract_presence_and_frequency_of_each_row_s_own_tokens(tokens, presence, frequency, dtype):
    logits = torch.randn(len(tokens), 8, generator=torch.Generator().manual_seed(len(tokens))).to(dtype)
    logits[0, 3] = -math.inf  # forbidden stays forbidden
    rows = [RowView(False, None, {}, (5, 5, 5), row) for row in tokens]  # the context is not counted
    scores = Scores(logits, torch.zeros(len(tokens)), 0, rows)
    Penalized(presence, frequency)(scores)
    expected = logits.float().clone()
    for r, row in enumerate(tokens):
        for t in set(row):
            expected[r, t] -= frequency * row.count(t) + presence
    assert scores.logits.dtype == dtype
    torch.testing.assert_close(scores.logits.float(), expected.to(dtype).float(), rtol=0.02, atol=0.05)
    assert scores.logits[0, 3] == -math.inf


def test_a_bias_is_added_to_its_tokens_in_every_row():
    scores = Scores(torch.zeros(3, 6), torch.zeros(3), 0, [RowView(False, None, {}, (), [])] * 3)
    Biased({1: 2.5, 4: -100.0})(scores)
    assert torch.equal(scores.logits, torch.tensor([[0.0, 2.5, 0.0, 0.0, -100.0, 0.0]] * 3))


class _Reference:
    """OpenAI's penalties and bias written plainly, as a transformers processor of one row
    whose prompt is ``start`` tokens long: the reference for the library's."""

    def __init__(self, start, presence, frequency, bias):
        self.start, self.presence, self.frequency, self.bias = start, presence, frequency, bias

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        generated = input_ids[0, self.start:].tolist()
        for t in set(generated):
            scores[0, t] -= self.frequency * generated.count(t) + self.presence
        for t, b in self.bias.items():
            scores[0, t] += b
        return scores


def test_a_call_s_penalties_and_bias_give_what_the_plain_reference_gives(model):
    from continuous import continuous, generate
    from continuous.layout import encode

    gen = continuous(generate.text(model))
    prompt = "User: Tell me about Alice and her cat."
    start = len(encode(model.tokenizer, prompt, special=True)[0])
    plain = gen(prompt, max_tokens=24, temperature=0)
    bias = {int(plain.token_ids[0, start + 1]): -3.0, 7: 1.5}
    options = dict(presence_penalty=0.8, frequency_penalty=1.5, logit_bias=bias)
    ours = gen(prompt, max_tokens=24, temperature=0, **options)
    reference = gen(prompt, max_tokens=24, temperature=0, logits_processors=[_Reference(start, 0.8, 1.5, bias)])
    assert ours.value == reference.value != plain.value
    sampled = gen(prompt, max_tokens=24, seed=3, **options)
    assert sampled.value == gen(prompt, max_tokens=24, seed=3,
                                logits_processors=[_Reference(start, 0.8, 1.5, bias)]).value


def test_a_strong_presence_penalty_never_repeats_and_a_strong_bias_always_wins(model):
    from continuous import continuous, generate

    gen = continuous(generate.text(model))
    prompt = "User: Tell me about Alice."
    state = gen(prompt, max_tokens=30, temperature=0, presence_penalty=1000.0)
    ids = state.token_ids[0, -30:].tolist()
    assert len(set(ids)) == len(ids)
    forced = gen(prompt, max_tokens=5, temperature=0, logit_bias={42: 1000.0})
    assert forced.token_ids[0, -5:].tolist() == [42] * 5


@pytest.mark.parametrize("options, error", [
    ({"logit_bias": {10**6: 1.0}}, ValueError), ({"logit_bias": {-1: 1.0}}, ValueError),
    ({"logit_bias": {"5": 1.0}}, ValueError), ({"logit_bias": {5: float("nan")}}, ValueError),
    ({"logit_bias": [(5, 1.0)]}, TypeError), ({"presence_penalty": float("inf")}, ValueError),
    ({"frequency_penalty": "1"}, ValueError),
])
def test_wrong_penalties_and_biases_are_refused_when_the_call_is_made(model, options, error):
    from continuous import continuous, generate

    with pytest.raises(error):
        continuous(generate.text(model))("Hi", max_tokens=2, **options)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.one_of(st.floats(-1e4, 1e4), st.just(-math.inf)), min_size=1, max_size=40))
def test_the_cost_s_log_sum_exp_equals_torch_s(values):
    row = torch.tensor(values, dtype=torch.float32)
    ours, theirs = _logsumexp(row[None])[0], torch.logsumexp(row, -1)
    if math.isinf(theirs):  # nothing allowed: NaN, which the cost reads as "removed nothing"
        assert not torch.isfinite(ours)
    else:
        assert torch.allclose(ours, theirs, atol=1e-3, rtol=1e-5)
