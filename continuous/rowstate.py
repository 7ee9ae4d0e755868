"""Per-row bookkeeping of one decoding call: text, rewinds, bans, healing.

The decoding loop chooses tokens for all rows at once; each row's text (UTF-8 pieces,
stop strings, what may be streamed), and what a rewind must undo (its tokens, the step
of each token's log-probability, the grid column it sits in, its bans per position),
live here, one :class:`RowState` per row.
"""

from __future__ import annotations

import bisect
import math
import warnings
from typing import Sequence

import torch

from .detok import Detokenizer
from .errors import BanExhausted
from .guides import RowMasks
from .heal import heal_length, token_strings
from .layout import Rows

__all__ = ["RowState", "MAX_REWINDS", "apply_bans", "rewind", "warn_exhausted", "heal_rows"]

#: Rewinds one row may make in one call before it gives up with its clean prefix.
MAX_REWINDS = 1000




class RowState:
    """Per-row bookkeeping of one decoding call (copied when beams reorder rows).

    It keeps what a rewind needs: each generated token, the step whose log-probability
    it carries (``None`` for a forced token), the column it sits in, and where its text ends.
    """

    __slots__ = ("origin", "context", "detok", "ends", "text", "pending", "finished", "stop", "dead",
                 "tokens", "steps", "slots", "released", "bans", "ban", "rewinds", "healed", "dangling",
                 "dangling_end")

    def __init__(self, origin: int, context: list[int], tokenizer, ban=None, healed: int = 0, hanging: int = 0):
        self.origin, self.context = origin, context
        self.healed = healed  # characters of the input that healing spells again (not part of the value)
        # The input's last tokens may end inside a character (an earlier call stopped there):
        # their text is decoded again with the tokens that complete it.
        self.dangling, self.dangling_end = hanging, None
        self.detok = Detokenizer(tokenizer, context[: len(context) - hanging])
        for t in context[len(context) - hanging:]:
            self.detok.step(t)
        self.ends: list[int] = []  # character ends, relative to the generated text
        self.text = ""
        self.pending = 0  # tokens waiting for the rest of an incomplete character
        self.finished = False
        self.stop: tuple[int, int] | None = None  # (start, end) of the stop string in text
        self.dead = False  # a beam left with no allowed token: it has no value
        self.tokens: list[int] = []
        self.steps: list[int | None] = []
        self.slots: list[int] = []
        self.released = healed  # characters already streamed (the re-spelled input was, as input)
        self.bans: dict[int, dict[int, float]] = {}  # position -> token -> factor (0: forbidden)
        self.ban = ban  # the ban list's matcher of this row, or None
        self.rewinds = 0

    def copy(self) -> "RowState":
        new = RowState.__new__(RowState)
        for name in self.__slots__:
            setattr(new, name, getattr(self, name))
        for name in ("ends", "tokens", "steps", "slots"):
            setattr(new, name, list(getattr(self, name)))
        new.bans = {k: dict(v) for k, v in self.bans.items()}
        new.detok = self.detok.copy()
        new.ban = self.ban.copy() if self.ban is not None else None
        return new

    def add(self, token_id: int, step: int | None, stop_at: Sequence[str], longest_stop: int):
        """Append a token; return a banned match's ``(start, factor)`` when its text makes one."""
        self.tokens.append(token_id)
        self.steps.append(step)
        piece = self.detok.step(token_id)
        if piece is None:
            self.pending += 1
            return None
        self._extend(piece)
        if stop_at:
            begin = max(0, len(self.text) - len(piece) - longest_stop + 1)
            hits = [(self.text.find(s, begin), s) for s in stop_at]
            hits = [(at, s) for at, s in hits if at >= 0]
            if hits:
                at, s = min(hits)
                self.stop = (at, at + len(s))
                self.finished = True
        if self.ban is not None:
            return self.ban.feed(piece)
        return None

    def _extend(self, piece: str) -> None:
        self.text += piece
        if self.dangling and self.dangling_end is None:
            self.dangling_end = len(self.text)
        self.ends.extend([len(self.text)] * (self.pending + 1))
        self.pending = 0

    def rewind(self, keep: int, tokenizer) -> None:
        """Go back to the first ``keep`` generated tokens."""
        del self.tokens[keep:], self.steps[keep:], self.slots[keep:], self.ends[keep:]
        self.text = self.text[: self.ends[-1]] if self.ends else ""
        self.pending = 0
        self.detok = Detokenizer(tokenizer, self.context[: len(self.context) - self.dangling])
        for t in self.context[len(self.context) - self.dangling:] + self.tokens:
            self.detok.step(t)
        if not self.text:
            self.dangling_end = None
        if self.stop is not None and self.stop[1] > len(self.text):
            self.stop = None
        self.finished = False
        for position in [p for p in self.bans if p > keep]:  # bans recorded after a prefix that changed
            del self.bans[position]
        if self.ban is not None:
            self.ban.rewind(len(self.text))

    def release(self) -> str | None:
        """The text that may be streamed now: all but what could still start a banned match."""
        end = self.stop[1] if self.stop else len(self.text)
        if not self.finished and self.ban is not None:
            end = min(end, len(self.text) - self.ban.held())
        piece = self.text[self.released:end] if end > self.released else ""
        self.released = max(self.released, end)
        return piece

    def flush(self) -> None:
        if self.pending:
            self.pending -= 1
            self._extend(self.detok.flush())

    @property
    def value_text(self) -> str | None:
        if self.dead:
            return None
        return (self.text[: self.stop[0]] if self.stop else self.text)[self.healed:]


def apply_bans(masked: torch.Tensor, state: list[RowState]) -> torch.Tensor:
    """Forbid (or down-weight) the tokens banned at each row's current position."""
    rows, tokens, shifts = [], [], []
    for r, row in enumerate(state):
        if not row.finished:
            for t, factor in row.bans.get(len(row.tokens), {}).items():
                rows.append(r)
                tokens.append(t)
                shifts.append(-math.inf if factor == 0 else math.log(factor))
    if not rows:
        return masked
    at = (torch.tensor(rows, device=masked.device), torch.tensor(tokens, device=masked.device))
    masked = masked.clone()
    masked[at] = masked[at] + torch.tensor(shifts, device=masked.device, dtype=masked.dtype)
    return masked


def rewind(row: RowState, r: int, match, chunk: list[int], masks: RowMasks, tokenizer, step_logprobs, weights,
            holes_at) -> list[int]:
    """Take a row back to the token where a banned match starts; return what is left of this step's chunk.

    The token that began the match is banned at that position (or its probability
    multiplied by the soft factor: a soft-banned phrase sampled again there stands).
    The row's weight loses the removed tokens' log-probabilities, its constraint rolls
    back, and the slots of removed tokens already in the grid become holes.
    """
    start, factor = match
    keep = bisect.bisect_right(row.ends, start)
    first = row.tokens[keep]
    here = row.bans.setdefault(keep, {})
    if factor > 0 and first in here:
        return chunk  # already down-weighted at this position and sampled again: it stands
    here[first] = factor
    for s in row.steps[keep:]:
        if s is not None:
            weights[r] -= step_logprobs[s][r]
    masks.rollback(r, len(row.tokens) - keep)
    for slot in row.slots[keep:]:
        holes_at(r, slot)
    new_chunk = chunk[: max(0, keep - (len(row.tokens) - len(chunk)))]
    row.rewind(keep, tokenizer)
    row.rewinds += 1
    if row.rewinds > MAX_REWINDS:
        warn_exhausted(r, row)
        row.finished = True
    return new_chunk


def warn_exhausted(r: int, row: RowState) -> None:
    warnings.warn(f"row {r} could not avoid a banned phrase after {row.rewinds} rewinds: it ends with its "
                  f"longest clean prefix ({len(row.tokens)} tokens)", BanExhausted, stacklevel=4)


def heal_rows(tokenizer, rows: Rows) -> tuple[Rows, list[str]]:
    """Crop each row's last tokens that a longer token could extend; return the rows and the removed texts."""
    strings = token_strings(tokenizer)
    cuts, healed = [], []
    for r, (text, ends) in enumerate(zip(rows.texts, rows.ends)):
        first = next((i for i, e in enumerate(ends) if e > 0), len(ends))  # the special prefix stays
        k = heal_length(strings, text, list(ends), first)
        cut = ends[-k - 1] if k and len(ends) > k else (0 if k else len(text))
        cuts.append(cut)
        healed.append(text[cut:])
    if not any(healed):
        return rows, healed
    return rows.with_text(tokenizer, cuts, [""] * rows.n_rows), healed
