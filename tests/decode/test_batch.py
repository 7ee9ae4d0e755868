"""One holder of a call's per-row arrays: a beam reorder moves every one of them."""

from dataclasses import fields

import torch

from continuous.decode import Decoding, Options
from continuous.engines import regex
from continuous.layout import Rows
from continuous.samplers import multinomial


def test_select_moves_every_per_row_field_together(model):
    rows = Rows.from_texts(model.tokenizer, ["a", "b c d"])
    constraint = regex("[0-9]+", model.tokenizer)
    batch = Decoding(model, rows, torch.tensor([-1.0, -2.0]), constraint,
                     Options(sampler=multinomial(), max_tokens=3)).prepare().batch
    batch.gained[:, 0] = torch.tensor([0.5, 0.25])
    before = {f.name: getattr(batch, f.name) for f in fields(batch)}
    batch.select([1, 1, 0], torch.tensor([1, 1, 0]))
    for name, value in before.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(getattr(batch, name), value[[1, 1, 0]]), name
    assert [row.written.context for row in batch.states] == [before["states"][i].written.context for i in (1, 1, 0)]
    assert batch.states[0] is not batch.states[1] and batch.states[0].history is not batch.states[1].history
    assert batch.grid.token_ids.shape[0] == len(batch.draws.streams) == len(batch.constraints.matchers) == 3
    assert batch.constraints.matchers[0] is not batch.constraints.matchers[1]
    assert batch.cache.rows == 3 and batch.logits_ok == [True] * 3


def test_recorded_steps_are_written_once_read_as_each_write_would_have(model):
    rows = Rows.from_texts(model.tokenizer, ["a", "b c d"])
    constraint = regex("[0-9]+", model.tokenizer)
    batch = Decoding(model, rows, torch.tensor([-1.0, -2.0]), constraint,
                     Options(sampler=multinomial(), max_tokens=3)).prepare().batch
    width = batch.gained.shape[1]
    columns = torch.rand(2, width + 70)  # past the first capacity, and past the steps kept aside
    costs = torch.rand(width + 70, 2)

    def shared(t):  # a step drawn with other calls' rows: before and after this call's two
        return torch.cat([torch.rand(1), t, torch.rand(3)])

    for step in range(width + 70):
        cost = costs[step] if step % 3 else None
        if step % 2:  # recorded as the step's tensors of every row, and this call's rows of them
            batch.record(step, shared(columns[:, step]), None if cost is None else shared(cost), slice(1, 3))
        else:
            batch.record(step, columns[:, step], cost)
    batch.record(5, torch.tensor([9.0, 8.0]))  # a step recorded again: the later one stands
    cost = costs[[s for s in range(width + 70) if s % 3]].sum(0)
    assert torch.allclose(batch.total_cost(), cost)  # read with steps still recorded
    batch.settle()
    columns[:, 5] = torch.tensor([9.0, 8.0])
    assert torch.equal(batch.gained[:, : width + 70], columns)
    assert torch.allclose(batch.cost, cost) and torch.equal(batch.total_cost(), batch.cost)
    batch.record(width + 70, torch.tensor([1.0, 2.0]))
    weights = batch.weights.clone()
    batch.give_back(1, [width + 70])  # reads what was just recorded
    assert torch.equal(batch.weights, weights - torch.tensor([0.0, 2.0]))
    batch.record(width + 71, torch.tensor([3.0, 4.0]))
    batch.select([1, 0], torch.tensor([1, 0]))  # rows move with their recorded steps
    assert batch.gained[:, width + 71].tolist() == [4.0, 3.0]
