"""Each row's constraint in a call: allowed tokens, forced runs, rollback, reordering."""

import pytest
import torch

from continuous.decode.constraints import RowConstraints
from continuous.engines import regex


def _allowed_ids(constraints, row):
    return {int(t) for t in constraints.allowed()[row].nonzero()}


def _constraints(tokenizer, pattern, rows=2, engine=None):
    constraint = regex(pattern, tokenizer, engine=engine)
    return RowConstraints(constraint, rows, len(tokenizer), len(tokenizer), tokenizer.eos_token_id,
                          torch.device("cpu"))


def test_a_forced_literal_is_forced_token_by_token_then_done(tokenizer):
    constraints = _constraints(tokenizer, "Paris")  # llguidance forces its canonical tokens
    spelled = []
    while not constraints.done(0):
        forced = constraints.forced(0)
        assert forced
        constraints.advance(0, forced[0])
        spelled.append(forced[0])
    assert tokenizer.decode(spelled) == "Paris"
    assert _allowed_ids(constraints, 0) == {tokenizer.eos_token_id}
    assert not constraints.done(1) and constraints.forced(1)  # the other row has not moved


def test_a_single_allowed_token_is_forced(tokenizer):
    constraints = _constraints(tokenizer, "7", engine="outlines_core")
    seven = tokenizer.convert_tokens_to_ids("7")
    assert _allowed_ids(constraints, 0) == {seven} and constraints.forced(0) == [seven]


def test_rows_move_on_their_own_and_roll_back(tokenizer):
    constraints = _constraints(tokenizer, "(ab|cd)e")
    start = _allowed_ids(constraints, 0)
    a = tokenizer.convert_tokens_to_ids("a")
    constraints.advance(0, a)
    assert _allowed_ids(constraints, 0) != start and _allowed_ids(constraints, 1) == start
    constraints.rollback(0, 1)
    assert _allowed_ids(constraints, 0) == start


def test_select_reorders_and_copies_rows(tokenizer):
    constraints = _constraints(tokenizer, "(ab|cd)e")
    a = tokenizer.convert_tokens_to_ids("a")
    constraints.advance(0, a)
    after_a = _allowed_ids(constraints, 0)
    constraints.select([0, 0, 1])
    assert [_allowed_ids(constraints, r) == after_a for r in range(3)] == [True, True, False]
    constraints.rollback(1, 1)  # a repeated row has its own matcher
    assert _allowed_ids(constraints, 0) == after_a and _allowed_ids(constraints, 1) != after_a


def test_free_text_allows_everything(tokenizer):
    constraints = RowConstraints(None, 2, len(tokenizer), len(tokenizer), tokenizer.eos_token_id,
                                 torch.device("cpu"))
    assert constraints.allowed() is None and not constraints.done(0) and constraints.forced(0) == []


def test_rows_of_several_calls_consumed_then_refreshed_together_equal_each_advanced_alone(tokenizer):
    def made():
        return [_constraints(tokenizer, "[0-9]+x", rows=3), _constraints(tokenizer, "(ab|cd)e", rows=2),
                _constraints(tokenizer, "[0-9]+x", rows=2), _constraints(tokenizer, "(ab|cd)e", rows=2)]

    calls, alone = made(), made()
    # Some rows of a call move and the others stay; every row moves, in order; every row, out of order.
    steps = [[(0, "1"), (2, "7")], [(1, "c")], [(0, "4"), (1, "2")], [(1, "c"), (0, "a")]]
    parts = []
    for c, a, moves in zip(calls, alone, steps):
        for r, text in moves:
            t = tokenizer.encode(text, add_special_tokens=False)[0]
            c.consume(r, t)
            a.advance(r, t)
        parts.append((c, [r for r, _ in moves]))
    RowConstraints.refresh_all(parts)
    for c, a in zip(calls, alone):
        assert torch.equal(c.bitmask, a.bitmask) and c.single == a.single
        assert [c.forced(r) for r in range(len(c.single))] == [a.forced(r) for r in range(len(a.single))]


def test_a_draw_whose_matchers_fail_fails_only_its_call_and_the_others_masks_are_written_at_once(model):
    """A shared draw moves every call's matchers past its tokens and writes their masks in one
    fill; a call whose matcher fails there gets its own error, the others go on."""
    from continuous.decode import Decoding, Options
    from continuous.decode.draw import Draw
    from continuous.layout import Rows

    def first_draw(decoding):
        steps = decoding.run()
        item = next(steps)
        while not isinstance(item, Draw):  # the prefill's forwards, then READY
            item = steps.send(model.forward(item.input_ids, item.attention_mask, item.cache, item.logits_to_keep)
                              if hasattr(item, "input_ids") else None)
        return steps, item

    # Whatever the first token ("a", or "a" and a digit), the mask after it differs from the first.
    decodings = [Decoding(model, Rows.from_texts(model.tokenizer, ["A code: "]), torch.zeros(1),
                          regex("a[0-9]", model.tokenizer), Options(max_tokens=4)) for _ in range(3)]
    (good, draw), (bad, broken), (_, alone) = map(first_draw, decodings)

    def fail(ids, dead):
        raise ValueError("the matcher broke")

    broken.consume = fail
    first_mask = decodings[0].batch.constraints.bitmask.clone()
    out = Draw.run_all([draw, broken])
    assert out[0].error is None and isinstance(out[1].error, ValueError)
    assert not torch.equal(decodings[0].batch.constraints.bitmask, first_mask)  # moved and written by the draw
    decodings[2].batch.constraints.advance(0, out[0].ids_h[0])  # the same token, taken alone
    assert torch.equal(decodings[0].batch.constraints.bitmask, decodings[2].batch.constraints.bitmask)
    with pytest.raises(ValueError, match="the matcher broke"):
        bad.send(out[1])
    good.send(out[0])  # the other call takes its token and goes on to its forward
    assert len(decodings[0].batch.states[0].tokens) == 1


@pytest.mark.parametrize("padded", [0, 37])
def test_the_bias_forbids_exactly_what_the_mask_does_also_eos_and_padded_ids_included(tokenizer, padded):
    """``bias()`` (added to logits) and ``allowed()`` (a boolean mask) say the same, row by row: an
    end-of-turn id where EOS is allowed, no id past the tokenizer's (a padded vocabulary)."""
    n = len(tokenizer)
    also = [t for t in range(n) if t != tokenizer.eos_token_id][-2:]
    constraint = regex("(Paris|Rome)[.!]?", tokenizer)
    constraints = RowConstraints(constraint, 3, n + padded, n, tokenizer.eos_token_id, torch.device("cpu"),
                                 also_eos=also)
    for token in tokenizer("Paris", add_special_tokens=False)["input_ids"]:
        constraints.advance(1, token)
    bias, allowed = constraints.bias(), constraints.allowed()
    assert bias.shape == allowed.shape == (3, n + padded) and bias.dtype == torch.float32
    assert torch.equal(bias == 0, allowed) and bool(torch.isneginf(bias[~allowed]).all())
    assert bool(allowed[1, also].all())  # row 1 may end: so may it with the end-of-turn ids
    free = RowConstraints(None, 2, n + padded, n, tokenizer.eos_token_id, torch.device("cpu"))
    if padded:
        assert torch.equal(free.bias() == 0, free.allowed()) and free.bias().shape == (n + padded,)
    else:
        assert free.bias() is None and free.allowed() is None
