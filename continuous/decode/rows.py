"""Per-row bookkeeping of one decoding call: text, stop strings, bans, what a rewind undoes.

The loop chooses tokens for all rows at once; each row's text (UTF-8 pieces, stop
strings, what may be streamed) and what a rewind must undo (its tokens, the step of
each token's log-probability, the grid slot it sits in, its bans per position) live
here, one :class:`RowState` per row.
"""

from __future__ import annotations

import bisect
import warnings
from dataclasses import dataclass
from typing import Sequence

from ..detok import Detokenizer, dangling
from ..errors import BanExhausted

__all__ = ["RowState", "StopStrings", "Rewind", "MAX_REWINDS", "warn_exhausted"]

#: Rewinds one row may make in one call before it gives up with its clean prefix.
MAX_REWINDS = 1000


class StopStrings:
    """The ``stop_at`` strings of a call: where the first of them ends a row's text."""

    def __init__(self, strings: Sequence[str]):
        self.strings = [s for s in strings if s]
        self.longest = max((len(s) for s in self.strings), default=0)

    def find(self, text: str, new: int, start: int = 0) -> tuple[int, int] | None:
        """``(start, end)`` of the earliest stop string after ``start`` that the last ``new`` characters complete."""
        begin = max(start, len(text) - new - self.longest + 1)
        hits = [(at, at + len(s)) for s in self.strings if (at := text.find(s, begin)) >= 0]
        return min(hits) if hits else None


@dataclass(frozen=True)
class Rewind:
    """What a rewind took back from a row: the tokens from ``keep`` on, their steps and slots."""

    keep: int
    removed: int
    steps: list[int | None]
    slots: list[int]


class RowState:
    """One row of one decoding call (copied when beams reorder rows).

    It keeps what a rewind needs: each generated token, the step whose log-probability
    it carries (``None`` for a forced token), the grid slot it sits in, and where its
    text ends. ``base_text`` and ``base_ends`` are the row's text and token ends before
    the call, less any last tokens whose text was held back (a character an earlier
    call left incomplete): their text is decoded again with the tokens that complete it.
    """

    __slots__ = ("input", "base_text", "base_ends", "context", "detok", "ends", "text", "pending", "finished", "reason", "stop",
                 "dead", "tokens", "steps", "slots", "released", "bans", "watchers", "rewinds", "healed", "dangling",
                 "dangling_end", "forced_next", "logprobs")

    def __init__(self, tokenizer, ids: list[int], text: str, ends: Sequence[int], watchers=(), healed: str = ""):
        hanging = dangling(tokenizer, ids)
        self.input = (text, tuple(ends))
        self.base_text = text[: ends[-hanging - 1] if len(ends) > hanging else 0] if hanging else text
        self.base_ends = tuple(ends[: len(ends) - hanging])
        self.context = ids
        self.healed = healed  # the input's text that healing spells again (not part of the value)
        self.dangling, self.dangling_end = hanging, None
        self.detok = self._detokenizer(tokenizer, [])
        self.ends: list[int] = []  # character ends, relative to the generated text
        self.text = ""
        self.pending = 0  # tokens waiting for the rest of an incomplete character
        self.finished = False
        self.reason: str | None = None  # why it finished: eos, stop, length, context, ban_exhausted
        self.stop: tuple[int, int] | None = None  # (start, end) of the stop string in text
        self.dead = False  # a beam left with no allowed token: it has no value
        self.tokens: list[int] = []
        self.steps: list[int | None] = []
        self.slots: list[int] = []
        self.released = len(healed)  # characters already streamed (the re-spelled input was, as input)
        self.bans: dict[int, dict[int, float]] = {}  # position -> token -> factor (0: forbidden)
        # What watches the generated text and makes the row rewind on a match: the ban
        # list's matcher, a relaxed JSON schema's watch (feed, finish, held, rewind, copy, and
        # ``broken``: what its last match broke, in words, for the exhausted warning).
        self.watchers = list(watchers)
        self.rewinds = 0
        self.forced_next: int | None = None  # the token the constraint forces next, taken at the next step
        self.logprobs: list[tuple] = []  # per token, when the call records them: (logprob, [(id, logprob)])

    def _detokenizer(self, tokenizer, tokens: list[int]) -> Detokenizer:
        cut = len(self.context) - self.dangling
        detok = Detokenizer(tokenizer, self.context[:cut])
        for t in self.context[cut:] + tokens:
            detok.step(t)
        return detok

    def copy(self) -> "RowState":
        new = RowState.__new__(RowState)
        for name in self.__slots__:
            setattr(new, name, getattr(self, name))
        for name in ("ends", "tokens", "steps", "slots", "logprobs"):
            setattr(new, name, list(getattr(self, name)))
        new.bans = {k: dict(v) for k, v in self.bans.items()}
        new.detok = self.detok.copy()
        new.watchers = [w.copy() for w in self.watchers]
        return new

    def add(self, token_id: int, step: int | None, stops: StopStrings) -> list[tuple]:
        """Append a token; return the matches its text makes, to rewind to.

        A match is ``(start, factor)`` (a banned phrase: back to its start) or
        ``(start, factor, end)`` (a value the schema forbids: back into it).
        """
        self.tokens.append(token_id)
        self.steps.append(step)
        piece = self.detok.step(token_id)
        if piece is None:
            self.pending += 1
            return []
        self._extend(piece)
        # Text that healing spells again was the input's: stop strings and bans look past it.
        echo = len(self.healed)
        if stops.strings and (hit := stops.find(self.text, len(piece), echo)) is not None:
            self.stop = hit
            self.finish("stop")
        if not self.watchers or len(self.text) <= echo:
            return []
        new = self.text[max(echo, len(self.text) - len(piece)):]
        return self._shifted(m for w in self.watchers for m in w.feed(new))

    def ending(self) -> list[tuple]:
        """The matches that the end of the row's text completes (before it finishes)."""
        return self._shifted(m for w in self.watchers for m in w.finish())

    def _shifted(self, matches) -> list[tuple]:
        # Watchers see the text after what healing spells again.
        return sorted((len(self.healed) + m[0],) + tuple(m[1:]) for m in matches)

    def _rewind_point(self, start: int, end: int | None = None) -> int:
        """How many tokens a rewind to a match at character ``start`` keeps.

        A phrase goes back to the token where it starts, or further to the last token
        that was sampled: a token the constraint forced could not be otherwise. A value
        (``end`` given) goes back to the first token the row chose within it, which
        decided it, if there is one.
        """
        keep = bisect.bisect_right(self.ends, start)
        if end is not None:
            k = keep
            while k < len(self.steps) and (self.ends[k - 1] if k else 0) < end:
                if self.steps[k] is not None:
                    return k
                k += 1
        while 0 < keep < len(self.steps) and self.steps[keep] is None:
            keep -= 1
        return keep

    def _extend(self, piece: str) -> None:
        self.text += piece
        if self.dangling and self.dangling_end is None:
            self.dangling_end = len(self.text)
        self.ends.extend([len(self.text)] * (self.pending + 1))
        self.pending = 0

    def rewind(self, match: tuple, tokenizer) -> Rewind | None:
        """Go back to the token a match points to (see :meth:`_rewind_point`).

        That token is banned at its position (or down-weighted by the soft factor: a
        soft-banned phrase sampled again there stands, and ``None`` is returned).
        """
        start, factor, end = match if len(match) == 3 else (*match, None)
        keep = self._rewind_point(start, end)
        here = self.bans.setdefault(keep, {})
        first = self.tokens[keep]
        if factor > 0 and first in here:
            return None
        here[first] = factor
        undone = Rewind(keep, len(self.tokens) - keep, self.steps[keep:], self.slots[keep:])
        del self.tokens[keep:], self.steps[keep:], self.slots[keep:], self.ends[keep:], self.logprobs[keep:]
        self.text = self.text[: self.ends[-1]] if self.ends else ""
        self.pending = 0
        self.detok = self._detokenizer(tokenizer, self.tokens)
        if not self.text:
            self.dangling_end = None
        if self.stop is not None and self.stop[1] > len(self.text):
            self.stop = None
        self.finished, self.reason, self.forced_next = False, None, None
        for position in [p for p in self.bans if p > keep]:  # bans recorded after a prefix that changed
            del self.bans[position]
        for w in self.watchers:
            w.rewind(max(0, len(self.text) - len(self.healed)))
        self.rewinds += 1
        return undone

    def finish(self, reason: str) -> None:
        """The row ends here, for ``reason``."""
        self.finished, self.reason = True, reason

    def release(self) -> str | None:
        """The text that may be streamed now (``None`` once finished and all given out).

        All but what could still start a banned match.
        """
        if self.finished and self.released >= len(self.text):
            return None
        end = self.stop[1] if self.stop else len(self.text)
        if not self.finished and self.watchers:
            # What a rewind could take back: from the token where a held match would start.
            held = len(self.text) - max(w.held() for w in self.watchers)
            keep = self._rewind_point(held)
            end = min(end, self.ends[keep - 1] if keep else 0) if keep < len(self.ends) else min(end, held)
        piece = self.text[self.released:end] if end > self.released else ""
        self.released = max(self.released, end)
        return piece

    def flush(self) -> None:
        if self.pending:
            self.pending -= 1
            self._extend(self.detok.flush())

    @property
    def value_text(self) -> str | None:
        """What the call generated for this row, as its value reads it (``None`` for a dead beam)."""
        if self.dead:
            return None
        return (self.text[: self.stop[0]] if self.stop else self.text)[len(self.healed):]

    @property
    def full_text(self) -> str:
        if not self.tokens:  # nothing new: held-back tokens keep the text they had
            return self.input[0]
        return self.base_text + self.text

    @property
    def cut(self) -> int:
        """Where the row's full text ends once the call is over: after its stop string, if any."""
        return len(self.base_text) + self.stop[1] if self.stop else len(self.full_text)

    @property
    def unspelled(self) -> str:
        """The healed text the call ended before spelling again (it goes back as text to encode)."""
        return self.healed[len(self.text):]

    def full_ends(self) -> tuple[int, ...]:
        """The character end of every token of the row: before the call, held back, and generated."""
        if not self.tokens:
            return self.input[1]
        base = len(self.base_text)
        held = (base + (self.dangling_end if self.dangling_end is not None else len(self.text)),) * self.dangling
        return self.base_ends + held + tuple(base + e for e in self.ends)


def warn_exhausted(r: int, row: RowState) -> None:
    broken = [w.broken for w in row.watchers if w.broken]
    what = f"a value its schema forbids ({'; '.join(broken)})" if broken else "a banned phrase"
    warnings.warn(f"row {r} could not avoid {what} after {row.rewinds} rewinds: it ends with its longest clean "
                  f"prefix ({len(row.tokens)} tokens)", BanExhausted, stacklevel=5)
    row.finish("ban_exhausted")
