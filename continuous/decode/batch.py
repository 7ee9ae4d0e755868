"""Every per-row array of one decoding call, in one place, reordered together."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Callable

import torch

from ..kv import stack
from ..samplers import RowDraws
from ..transfer import cat_rows
from .constraints import RowConstraints
from .grid import Grid
from .rows import RowState

__all__ = ["Batch"]

#: Recorded steps kept at most before they are written (their tensors hold memory).
_SETTLE_EVERY = 64


@dataclass(kw_only=True)
class Batch:
    """The rows of a call, one entry per row in every field (beams reorder them all at once).

    Attributes
    ----------
    logits
        ``[rows, vocab]`` the scores after each row's newest token, on the device.
    start
        ``[rows, vocab]`` the scores at the start of the call (a rewind to there takes them back).
    weights
        ``[rows]`` each row's log-probability under the sampler, on the device.
    gained
        ``[rows, steps]`` what each step added to each row's weight (a rewind gives it back);
        current after :meth:`settle`.
    cost
        ``[rows]`` the nats the constraint removed over the call's steps; current after
        :meth:`settle`.
    cache
        The rows' KV cache.
    grid
        Their slots and attention mask.
    constraints
        Their constraint matchers and allowed tokens.
    draws
        Their random streams (``None`` when the sampler draws nothing).
    states
        Their text and history.
    logits_ok
        Whether each row's ``logits`` are those after its newest token.
    """

    logits: torch.Tensor
    start: torch.Tensor
    weights: torch.Tensor
    gained: torch.Tensor
    cost: torch.Tensor
    cache: Any
    grid: Grid
    constraints: RowConstraints
    draws: RowDraws | None
    states: list[RowState]
    logits_ok: list[bool]
    # Steps recorded and not yet written into ``gained`` and ``cost``: writing each step at
    # once would be a device op per call per step (a kernel launch on a GPU).
    _recorded: list[tuple[int, torch.Tensor, torch.Tensor | None, slice]] = field(default_factory=list, repr=False)

    @classmethod
    def joined(cls, parts: list["Batch"], device: torch.device) -> "Batch":
        """The rows of several calls' batches at their first step (nothing recorded yet), one after the
        other: their caches are stacked (:func:`~continuous.kv.stack`), their grids side by side."""
        steps = max(p.gained.shape[1] for p in parts)
        n = sum(len(p.states) for p in parts)
        logits = cat_rows([p.logits for p in parts])  # at the first step, also where each row started
        return cls(logits=logits, start=logits, weights=torch.cat([p.weights for p in parts]),
                   gained=torch.zeros(n, steps, device=device), cost=torch.zeros(n, device=device),
                   cache=stack([p.cache for p in parts], [len(p.states) for p in parts], steps),
                   grid=Grid.joined([p.grid for p in parts], device),
                   constraints=RowConstraints.joined([p.constraints for p in parts]),
                   draws=None if parts[0].draws is None else RowDraws.joined([p.draws for p in parts]),
                   states=[s for p in parts for s in p.states], logits_ok=[ok for p in parts for ok in p.logits_ok])

    def select(self, rows: list[int], index: torch.Tensor) -> None:
        """Row ``i`` becomes row ``rows[i]`` in every field (``index``: ``rows`` on the device)."""
        self.settle()
        for f in fields(self):
            if not f.name.startswith("_"):
                setattr(self, f.name, _select(getattr(self, f.name), rows, index))

    def record(self, step: int, gained: torch.Tensor, cost: torch.Tensor | None = None,
               span: slice = slice(None)) -> None:
        """Keep what step ``step`` added to each row's weight, and the nats the constraint removed
        (``None``: none): ``gained[span]`` and ``cost[span]`` are the rows' (a step shared by
        several calls records its tensors of every row, taken apart only when written)."""
        self._recorded.append((step, gained, cost, span))
        if len(self._recorded) >= _SETTLE_EVERY:
            self.settle()

    def total_cost(self) -> torch.Tensor:
        """``[rows]`` the nats the constraint removed so far, the recorded steps' included (left recorded)."""
        return self.cost_so_far()()

    def cost_so_far(self) -> Callable[[], torch.Tensor]:
        """:meth:`total_cost` as of now, summed when called (the call may go on meanwhile)."""
        base, costs = self.cost, [(cost, span) for _, _, cost, span in self._recorded if cost is not None]
        return lambda: base + _side_by_side(costs).sum(1) if costs else base

    def settle(self) -> None:
        """Write the recorded steps into ``gained`` and ``cost``."""
        if not self._recorded:
            return
        self.cost = self.total_cost()
        recorded, self._recorded = self._recorded, []
        steps = [step for step, *_ in recorded]
        first, last = steps[0], max(steps)
        while last >= self.gained.shape[1]:  # doubling: rewinds make more steps than tokens
            self.gained = torch.cat([self.gained, torch.zeros_like(self.gained)], 1)
        columns = _side_by_side([(gained, span) for _, gained, _, span in recorded])
        if steps == list(range(first, first + len(steps))):  # each step once, in order: one block
            self.gained[:, first : last + 1] = columns
        else:
            latest = {step: j for j, step in enumerate(steps)}  # a step recorded again: the later stands
            self.gained[:, list(latest)] = columns[:, list(latest.values())]

    def give_back(self, row: int, steps: list[int]) -> None:
        """Take back from a row's weight what steps ``steps`` gave it."""
        if steps:
            self.settle()
            self.weights[row] -= self.gained[row, steps].sum()


def _side_by_side(parts: list[tuple[torch.Tensor, slice]]) -> torch.Tensor:
    """``[rows, len(parts)]``: each part's ``tensor[rows]``, side by side. A run of parts with the
    same rows of tensors of one length (a call's steps while the same calls draw together) is
    stacked whole and cut once."""
    blocks, i = [], 0
    while i < len(parts):
        first, rows = parts[i]
        j = i + 1
        while j < len(parts) and parts[j][1] == rows and parts[j][0].shape == first.shape:
            j += 1
        blocks.append(torch.stack([t for t, _ in parts[i:j]], 1)[rows])
        i = j
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks, 1)


def _select(value, rows: list[int], index: torch.Tensor):
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return value[index]
    if isinstance(value, list):
        return [value[a].copy() if hasattr(value[a], "copy") else value[a] for a in rows]
    if hasattr(value, "select_rows"):  # a KV cache
        return value.select_rows(index)
    return value.select(rows, index)
