"""The grid of slots one decoding call appends to: token ids, holes and the attention mask.

Each step appends one or more columns, right-aligned so that every row's newest token
sits in the last slot, where its logits are read. A row that generates fewer tokens
than the widest row of a step (fast-forward), a finished row, and tokens a rewind
takes back leave holes. The host keeps the ids and which slots are real; the device
keeps the attention mask that forwards read, updated with the same columns.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..layout import Rows, interior_holes
from ..transfer import to_device

__all__ = ["Grid", "Frozen"]


class Grid:
    """The slots of a call's rows: those of the input, then one column per generated slot.

    Parameters
    ----------
    rows
        The rows the call continues (their cache covers every slot).
    device
        Where the forwards read the attention mask.

    Attributes
    ----------
    attention_mask
        ``[rows, slots]`` on the device, 0 on padding and holes.
    all_real
        No padding and no hole so far: forwards need no mask.
    holes
        Some row has a hole between two of its tokens (sliding windows count positions).
    """

    def __init__(self, rows: Rows, device: torch.device):
        self._start(rows.token_ids, rows.attention_mask, rows.pad, device)

    def _start(self, token_ids: torch.Tensor, real: torch.Tensor, pad: int, device: torch.device) -> None:
        self.pad = pad
        self.token_ids, self.real = token_ids, real  # host copies, reordered with the rows
        self.width0 = token_ids.shape[1]
        self.columns: list[list[int]] = []  # generated ids per column (pad for holes), host
        self.reals: list[list[bool]] = []  # per column, which rows hold a real token there
        self._mask = real.to(device)
        self._ones_after = 0  # columns of ones appended to the mask and not yet made (plain steps)
        self.all_real = bool(real.all())
        self.holes = not self.all_real and interior_holes(real)
        # Per row, whether it ends in a hole (it finished, or was cut shorter): its next token
        # makes that hole interior.
        self.trailing = [False] * len(real) if self.all_real else (real[:, -1] == 0).tolist()
        self._ones = torch.ones((len(real), 1), dtype=torch.bool, device=device)
        self.last_real: torch.Tensor | None = None  # [rows, width] of the last append, on the device

    @classmethod
    def joined(cls, grids: list["Grid"], device: torch.device) -> "Grid":
        """The rows of grids with no generated column yet, one after the other, each left-aligned:
        the slots past a shorter grid's are holes (as :func:`~continuous.kv.stack` lays out their caches)."""
        width = max(g.width0 for g in grids)
        grid = cls.__new__(cls)
        grid._start(torch.cat([F.pad(g.token_ids, (0, width - g.width0), value=g.pad) for g in grids]),
                    torch.cat([F.pad(g.real, (0, width - g.width0)) for g in grids]), grids[0].pad, device)
        return grid

    @property
    def attention_mask(self) -> torch.Tensor:
        if self._ones_after:  # made when read: forwards of rows with no hole never read it
            self._mask = torch.cat([self._mask, self._mask.new_ones((self._mask.shape[0], self._ones_after))], 1)
            self._ones_after = 0
        return self._mask

    @attention_mask.setter
    def attention_mask(self, mask: torch.Tensor) -> None:
        self._mask, self._ones_after = mask, 0

    def select(self, rows: list[int], index: torch.Tensor) -> "Grid":
        """Keep rows ``rows`` (host list) in that order; ``index`` is the same on the device."""
        self.attention_mask = self.attention_mask[index]
        self.token_ids, self.real = self.token_ids[rows], self.real[rows]
        self.columns = [[col[a] for a in rows] for col in self.columns]
        self.reals = [[col[a] for a in rows] for col in self.reals]
        self.trailing = [self.trailing[a] for a in rows]
        return self

    def hole_at(self, row: int, slot: int) -> None:
        """Turn a generated token's slot into a hole (its column is made anew: a frozen grid keeps the old)."""
        self.reals[slot] = [ok and r != row for r, ok in enumerate(self.reals[slot])]
        self.columns[slot] = [self.pad if r == row else t for r, t in enumerate(self.columns[slot])]
        self.attention_mask[row, self.width0 + slot] = 0

    def reject(self, row: int, slot: int) -> None:
        """A drafted token's slot becomes a hole: the model did not keep it (the row ends in a hole)."""
        self.hole_at(row, slot)
        self.trailing[row] = True
        self.all_real = False

    def drop_empty_tail(self) -> int:
        """Drop the newest columns where no row holds a real token (drafts no row kept); return
        the slots left. The next step then writes over them: a cache cropped to the same width
        holds no hole for them, and a row that ends in a real token is whole again."""
        n = len(self.columns)
        while n and not any(self.reals[n - 1]):
            n -= 1
        if n < len(self.columns):
            del self.columns[n:], self.reals[n:]
            self.attention_mask = self.attention_mask[:, : self.width0 + n]
            last = self.reals[n - 1] if n else (self.real[:, -1] == 1).tolist()
            self.trailing = [not ok for ok in last]
            self.all_real = bool(self.real.all()) and all(map(all, self.reals))
        return self.width0 + n

    def append(self, chunks: list[list[int]], plain: bool, rewound: bool) -> tuple[list[range], list[list[int]]]:
        """Append each row's new tokens, right-aligned; return each row's slots and the new ids.

        ``plain`` says that every row appends exactly its sampled token, so the device
        mask grows by a column of ones with no host-to-device copy (it would wait for the
        device); so does any step of one token per row. ``rewound`` says that some row took
        tokens back, leaving holes.
        """
        if all(len(c) == 1 for c in chunks):
            slot = self.append_one([c[0] for c in chunks], rewound)
            return [range(slot, slot + 1)] * len(chunks), [[c[0]] for c in chunks]
        width = max(len(c) for c in chunks)
        real = [[j >= width - len(c) for j in range(width)] for c in chunks]
        ids = [[c[j - width + len(c)] if ok[j] else self.pad for j in range(width)] for c, ok in zip(chunks, real)]
        slots = [range(len(self.columns) + width - len(c), len(self.columns) + width) for c in chunks]
        self.columns.extend(map(list, zip(*ids)))
        self.reals.extend(map(list, zip(*real)))
        if plain:
            self.last_real = self._ones
            self._ones_after += 1
        else:
            self.last_real = to_device(real, self._ones.device, torch.bool)
            self.attention_mask = torch.cat([self.attention_mask, self.last_real.long()], 1)
        self.all_real = self.all_real and all(map(all, real)) and not rewound
        self.holes = self.holes or rewound or any(0 < len(c) and (len(c) < width or ends_in_hole)
                                                  for c, ends_in_hole in zip(chunks, self.trailing))
        if width:
            self.trailing = [not c for c in chunks]
        return slots, ids

    def append_one(self, ids: list[int], rewound: bool) -> int:
        """:meth:`append` of one token per row (most steps), ``ids``; returns their slot. A
        column with no hole: the device mask grows by ones whether or not the tokens are the
        sampled ones."""
        slot = len(self.columns)
        self.columns.append(ids)
        self.reals.append([True] * len(ids))
        self.last_real = self._ones
        self._ones_after += 1
        self.all_real = self.all_real and not rewound
        self.holes = self.holes or rewound or any(self.trailing)
        self.trailing = [False] * len(ids)
        return slot

    def layout(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The host token ids and attention mask of every slot, the generated columns included."""
        return self.frozen().layout()

    def frozen(self) -> "Frozen":
        """The slots as they are now, whatever the grid appends or turns into holes later."""
        return Frozen(self.token_ids, self.real, self.columns[:], self.reals[:])


class Frozen(NamedTuple):
    """A grid's slots at one moment (see :meth:`Grid.frozen`): its input's ids and mask (replaced,
    never written), and its generated columns (each made anew when it changes)."""

    token_ids: torch.Tensor
    real: torch.Tensor
    columns: list[list[int]]
    reals: list[list[bool]]

    def layout(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The host token ids and attention mask of every slot, the generated columns included."""
        if not self.columns:
            return self.token_ids, self.real
        return (torch.cat([self.token_ids, torch.tensor(self.columns, dtype=torch.long).T], 1),
                torch.cat([self.real, torch.tensor(self.reals, dtype=torch.long).T], 1))
