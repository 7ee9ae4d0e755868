"""Each row's constraint in a call: allowed tokens, forced runs, rollback, reordering."""

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
    from continuous.decode.constraints import Refresh

    calls = [_constraints(tokenizer, "[0-9]+x", rows=3), _constraints(tokenizer, "(ab|cd)e", rows=2)]
    alone = [_constraints(tokenizer, "[0-9]+x", rows=3), _constraints(tokenizer, "(ab|cd)e", rows=2)]
    steps = [[(0, "1"), (2, "7")], [(1, "c")]]  # some rows of each call move, the others stay
    items = []
    for c, a, moves in zip(calls, alone, steps):
        for r, text in moves:
            t = tokenizer.encode(text, add_special_tokens=False)[0]
            c.consume(r, t)
            a.advance(r, t)
        items.append(Refresh(c, [r for r, _ in moves]))
    assert len({item.key for item in items}) == 1  # the engine runs them as one
    assert Refresh.run_all(items) == [None, None]
    for c, a in zip(calls, alone):
        assert torch.equal(c.bitmask, a.bitmask) and c.single == a.single
        assert [c.forced(r) for r in range(len(c.single))] == [a.forced(r) for r in range(len(a.single))]


def test_a_call_closed_while_its_masks_wait_to_be_written_leaves_its_matchers_with_its_rows(model):
    """The tokens a call's matchers consumed before its rows took them are given back when
    the call ends there: its state's text and its constraint agree."""
    from continuous.decode import Decoding, Options
    from continuous.decode.draw import Draw
    from continuous.layout import Rows

    constraint = regex("[0-9]", model.tokenizer)  # one digit: the consumed token alone would complete it
    rows = Rows.from_texts(model.tokenizer, ["A digit: "])
    decoding = Decoding(model, rows, torch.zeros(1), constraint, Options(max_tokens=3))
    steps = decoding.run()
    item = next(steps)
    while not isinstance(item, Draw):  # the prefill's forwards, then READY
        item = steps.send(model.forward(item.input_ids, item.attention_mask, item.cache, item.logits_to_keep)
                          if hasattr(item, "input_ids") else None)
    before = decoding.batch.constraints.bitmask.clone()
    refresh = steps.send(Draw.run_all([item])[0])
    assert refresh.rows == [0]  # the matcher moved; its mask is not written yet
    steps.close()
    assert torch.equal(decoding.batch.constraints.bitmask, before)
    assert decoding.result().texts == [""] and decoding.batch.constraints.complete() == [False]
