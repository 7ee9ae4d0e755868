"""Every per-row array of one decoding call, in one place, reordered together."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from ..samplers import RowDraws
from .constraints import RowConstraints
from .grid import Grid
from .rows import RowState

__all__ = ["Batch"]


@dataclass
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
        ``[rows, steps]`` what each step added to each row's weight (a rewind gives it back).
    cost
        ``[rows]`` the nats the constraint removed over the call's steps.
    cache
        The rows' KV cache.
    grid
        Their slots and attention mask.
    constraints
        Their constraint matchers and allowed tokens.
    draws
        Their random streams (``None`` when the sampler draws nothing).
    rows
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
    rows: list[RowState]
    logits_ok: list[bool]

    def select(self, rows: list[int], index: torch.Tensor) -> None:
        """Row ``i`` becomes row ``rows[i]`` in every field (``index``: ``rows`` on the device)."""
        for f in fields(self):
            setattr(self, f.name, _select(getattr(self, f.name), rows, index))

    def record(self, step: int, gained: torch.Tensor) -> None:
        """Keep what step ``step`` added to each row's weight."""
        if step >= self.gained.shape[1]:  # doubling: rewinds make more steps than tokens
            self.gained = torch.cat([self.gained, torch.zeros_like(self.gained)], 1)
        self.gained[:, step] = gained

    def give_back(self, row: int, steps: list[int]) -> None:
        """Take back from a row's weight what steps ``steps`` gave it."""
        if steps:
            self.weights[row] -= self.gained[row, steps].sum()


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
