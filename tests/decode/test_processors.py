"""The logits processors: constraint, bans, finished rows and beam ranking shape the scores."""

import math

import torch

from continuous.decode.constraints import RowConstraints
from continuous.decode.processors import (
    Banned,
    Constrained,
    Finished,
    ForkRanking,
    Scores,
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
    scores.rows = _rows(tokenizer, 2, finished={1})
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
    scores = run([lambda s: calls.append(1), lambda s: calls.append(2)], given.logits, given.rank, 0, given.rows)
    assert calls == [1, 2] and isinstance(scores, Scores)
