"""Per-row bookkeeping of one decoding call: its text, what a rewind undoes, and how it ended.

The loop chooses tokens for all rows at once; each row keeps a :class:`RowState` of two
parts: :class:`RowText` (UTF-8 pieces, stop strings, what may be streamed) and
:class:`RowHistory` (its tokens, the step of each token's log-probability, the grid
slot it sits in, its bans per position and its watches: what a rewind must undo).
Copies (beams; what a stream's consumer has seen) copy each mutable field explicitly: they
run at every step of a stream, and a generic walk over the fields cost twice as much.
"""

from __future__ import annotations

import bisect
import copy
import warnings
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping, NamedTuple, Sequence

from ..detok import Detokenizer, dangling
from ..engines import Match, Watch
from ..errors import BanExhausted
from .finish import Finish

__all__ = ["RowState", "RowText", "RowHistory", "RowView", "StopStrings", "Rewind", "MAX_REWINDS",
           "warn_exhausted"]

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
    steps: list[int]
    slots: list[int]


#: A row's bans where it has none (one object, never written: views are made at every step).
_NO_BANS: Mapping[int, float] = MappingProxyType({})


class RowView(NamedTuple):
    """What processors read of a row at one step (read-only)."""

    finished: bool
    forced: int | None  # the token its constraint forces now, if one
    banned: Mapping[int, float]  # token -> factor at its current position
    context: tuple[int, ...]  # its tokens before the call
    tokens: list[int]  # its tokens generated so far


@dataclass
class RowText:
    """A row's text: the input's (``base_text``, ``base_ends``, less any last tokens whose
    text an earlier call held back, a character left incomplete: decoded again here with
    the tokens that complete it), what the call generated, its stop string and what was
    streamed."""

    input: tuple[str, tuple[int, ...]]
    base_text: str
    base_ends: tuple[int, ...]
    context: tuple[int, ...]
    healed: str  # the input's text that healing spells again (not part of the value)
    dangling: int
    detok: Detokenizer
    dangling_end: int | None = None
    ends: list[int] = field(default_factory=list)  # character ends, relative to the generated text
    text: str = ""
    pending: int = 0  # tokens waiting for the rest of an incomplete character
    stop: tuple[int, int] | None = None  # (start, end) of the stop string in text
    released: int = 0  # characters already streamed (the re-spelled input was, as input)

    @classmethod
    def of(cls, tokenizer, ids: Sequence[int], text: str, ends: Sequence[int], healed: str) -> "RowText":
        hanging = dangling(tokenizer, ids)
        base = text[: ends[-hanging - 1] if len(ends) > hanging else 0] if hanging else text
        new = cls((text, tuple(ends)), base, tuple(ends[: len(ends) - hanging]), tuple(ids), healed, hanging, None)
        new.released = len(healed)
        new.restart(tokenizer, [])
        return new

    def copy(self) -> "RowText":
        """An independent copy (its other fields are strings, numbers and tuples: shared as they are)."""
        new = copy.copy(self)
        new.detok, new.ends = self.detok.copy(), self.ends[:]
        return new

    def restart(self, tokenizer, tokens: list[int]) -> None:
        """Decode again from the context's held-back tokens and ``tokens`` (after a rewind)."""
        cut = len(self.context) - self.dangling
        self.detok = Detokenizer(tokenizer, self.context[:cut])
        for t in self.context[cut:] + tuple(tokens):
            self.detok.step(t)

    def add(self, token_id: int) -> str | None:
        """The text a token adds (``None`` while a character is incomplete)."""
        piece = self.detok.step(token_id)
        if piece is None:
            self.pending += 1
        else:
            self._extend(piece)
        return piece

    def _extend(self, piece: str) -> None:
        self.text += piece
        if self.dangling and self.dangling_end is None:
            self.dangling_end = len(self.text)
        self.ends.extend([len(self.text)] * (self.pending + 1))
        self.pending = 0

    def keep(self, n: int) -> None:
        """Keep the first ``n`` generated tokens' text."""
        del self.ends[n:]
        self.text = self.text[: self.ends[-1]] if self.ends else ""
        self.pending = 0
        if not self.text:
            self.dangling_end = None
        if self.stop is not None and self.stop[1] > len(self.text):
            self.stop = None

    def flush(self) -> None:
        if self.pending:
            self.pending -= 1
            self._extend(self.detok.flush())

    def full_text(self, generated: bool) -> str:
        if not generated:  # nothing new: held-back tokens keep the text they had
            return self.input[0]
        return self.base_text + self.text

    def full_ends(self, generated: bool) -> tuple[int, ...]:
        """The character end of every token of the row: before the call, held back, and generated."""
        if not generated:
            return self.input[1]
        base = len(self.base_text)
        held = (base + (self.dangling_end if self.dangling_end is not None else len(self.text)),) * self.dangling
        return self.base_ends + held + tuple(base + e for e in self.ends)


@dataclass
class RowHistory:
    """What a row chose in the call, and what a rewind needs to undo it."""

    watchers: list[Watch]  # the ban list's matcher, a relaxed schema's watch
    tokens: list[int] = field(default_factory=list)
    steps: list[int | None] = field(default_factory=list)  # per token, the step of its log-probability
    slots: list[int] = field(default_factory=list)  # per token, its grid slot
    logprobs: list[tuple] = field(default_factory=list)  # per token (and a sampled end): (id, logprob, alternatives)
    bans: dict[int, dict[int, float]] = field(default_factory=dict)  # position -> token -> factor (0: forbidden)
    rewinds: int = 0
    ended: tuple[int, int] | None = None  # (step, id) of a sampled end id, which ended the row

    def copy(self) -> "RowHistory":
        """An independent copy: the watches copied, the lists and bans anew (their items, numbers and
        tuples, shared as they are)."""
        return RowHistory([w.copy() for w in self.watchers], self.tokens[:], self.steps[:], self.slots[:],
                          self.logprobs[:], {at: dict(banned) for at, banned in self.bans.items()}, self.rewinds,
                          self.ended)


@dataclass
class RowState:
    """One row of one decoding call (copied when beams reorder rows)."""

    written: RowText
    history: RowHistory
    finished: bool = False
    reason: Finish | None = None
    dead: bool = False  # a beam left with no allowed token: it has no value
    forced_next: int | None = None  # the token the constraint forces next, taken at the next step

    @classmethod
    def of(cls, tokenizer, ids: Sequence[int], text: str, ends: Sequence[int], watchers=(), healed: str = ""
           ) -> "RowState":
        """A row before the call: its tokens, text and token ends; its watches; the text healing re-spells."""
        return cls(RowText.of(tokenizer, ids, text, ends, healed), RowHistory(list(watchers)))

    def copy(self) -> "RowState":
        return RowState(self.written.copy(), self.history.copy(), self.finished, self.reason, self.dead,
                        self.forced_next)

    @property
    def tokens(self) -> list[int]:
        return self.history.tokens

    def view(self) -> RowView:
        banned = _NO_BANS if self.finished else self.history.bans.get(len(self.tokens), _NO_BANS)
        return RowView(self.finished, self.forced_next, banned, self.written.context, self.tokens)

    def add(self, token_id: int, step: int | None, stops: StopStrings) -> list[Match]:
        """Append a token; return the matches its text makes, to rewind to."""
        text, history = self.written, self.history
        history.tokens.append(token_id)
        history.steps.append(step)
        piece = text.add(token_id)
        if piece is None:
            return []
        # Text that healing spells again was the input's: stop strings and bans look past it.
        echo = len(text.healed)
        if stops.strings and (hit := stops.find(text.text, len(piece), echo)) is not None:
            text.stop = hit
            self.finish(Finish.STOP)
        if not history.watchers or len(text.text) <= echo:
            return []
        new = text.text[max(echo, len(text.text) - len(piece)):]
        return self._shifted(m for w in history.watchers for m in w.feed(new))

    def end(self, token_id: int, step: int) -> None:
        """The row sampled an end id."""
        self.history.ended = (step, token_id)
        self.finish(Finish.EOS)

    def ending(self) -> list[Match]:
        """The matches that the end of the row's text completes (before it finishes)."""
        return self._shifted(m for w in self.history.watchers for m in w.finish())

    def _shifted(self, matches) -> list[Match]:
        # Watchers see the text after what healing spells again.
        return sorted((m.shifted(len(self.written.healed)) for m in matches), key=lambda m: (m.start, m.factor))

    def _back_to_choice(self, keep: int) -> int:
        """From token ``keep`` back to the nearest token the row sampled (a forced token could
        not be otherwise)."""
        steps = self.history.steps
        while 0 < keep < len(steps) and steps[keep] is None:
            keep -= 1
        return keep

    def _rewind_point(self, match: Match) -> int:
        """How many tokens a rewind on ``match`` keeps.

        A value goes back to the first token the row chose within it, which decided it.
        A phrase goes back to the token where it starts, or further to the last token
        that was sampled; but when the constraint forced every token of the phrase, the
        last real choice is what made it whole: the token after it (an end id included),
        if the row sampled it.
        """
        ends, steps = self.written.ends, self.history.steps
        keep = bisect.bisect_right(ends, match.start)
        if match.value:
            for k in range(keep, len(steps)):
                if (ends[k - 1] if k else 0) >= match.end:
                    break
                if steps[k] is not None:
                    return k
            return self._back_to_choice(keep)
        after = bisect.bisect_left(ends, match.end) + 1  # the token after the phrase
        if all(s is None for s in steps[keep:after]):
            if after < len(steps) and steps[after] is not None:
                return after
            if after == len(steps) and self.history.ended is not None:
                return after
        return self._back_to_choice(keep)

    def rewind(self, match: Match, tokenizer) -> Rewind | None:
        """Go back to the token a match points to (see :meth:`_rewind_point`).

        That token is banned at its position (or down-weighted by the soft factor: a
        soft-banned phrase sampled again there stands, and ``None`` is returned).
        """
        history = self.history
        keep = self._rewind_point(match)
        ended = history.ended if keep == len(history.tokens) else None
        first = ended[1] if ended is not None else history.tokens[keep]
        here = history.bans.setdefault(keep, {})
        if match.factor > 0 and first in here:
            return None
        here[first] = match.factor
        steps = history.steps[keep:] + ([ended[0]] if ended is not None else [])
        undone = Rewind(keep, len(history.tokens) - keep, [s for s in steps if s is not None], history.slots[keep:])
        del history.tokens[keep:], history.steps[keep:], history.slots[keep:], history.logprobs[keep:]
        history.ended = None
        self.written.keep(keep)
        self.written.restart(tokenizer, history.tokens)
        self.finished, self.reason, self.forced_next = False, None, None
        for position in [p for p in history.bans if p > keep]:  # bans recorded after a prefix that changed
            del history.bans[position]
        for w in history.watchers:
            w.rewind(max(0, len(self.written.text) - len(self.written.healed)))
        history.rewinds += 1
        return undone

    def finish(self, reason: Finish) -> None:
        """The row ends here, for ``reason`` (the first reason stands)."""
        if not self.finished:
            self.finished, self.reason = True, reason

    def release(self) -> str | None:
        """The text that may be streamed now (``None`` once finished and all given out).

        All but what could still start a banned match.
        """
        text = self.written
        if self.finished and text.released >= len(text.text):
            return None
        end = text.stop[1] if text.stop else len(text.text)
        if not self.finished and self.history.watchers:
            # What a rewind could take back: from the token where a held match would start.
            held = len(text.text) - max(w.held() for w in self.history.watchers)
            keep = self._back_to_choice(bisect.bisect_right(text.ends, held))
            end = min(end, text.ends[keep - 1] if keep else 0) if keep < len(text.ends) else min(end, held)
        piece = text.text[text.released:end] if end > text.released else ""
        text.released = max(text.released, end)
        return piece

    def flush(self) -> None:
        self.written.flush()

    def value_text(self, whole: bool = False) -> str | None:
        """What the call generated for this row, as its value reads it (``None`` for a dead beam);
        ``whole``: the stop string stays (a constraint's match that it ends)."""
        if self.dead:
            return None
        text = self.written
        return (text.text[: text.stop[0]] if text.stop and not whole else text.text)[len(text.healed):]

    @property
    def full_text(self) -> str:
        return self.written.full_text(bool(self.tokens))

    def full_ends(self) -> tuple[int, ...]:
        return self.written.full_ends(bool(self.tokens))

    @property
    def cut(self) -> int:
        """Where the row's full text ends once the call is over: after its stop string, if any."""
        text = self.written
        return len(text.base_text) + text.stop[1] if text.stop else len(self.full_text)

    @property
    def unspelled(self) -> str:
        """The healed text the call ended before spelling again (it goes back as text to encode)."""
        return self.written.healed[len(self.written.text):]


def warn_exhausted(r: int, row: RowState, why: str | None = None) -> None:
    """End a row that has no way on, with a :class:`~continuous.errors.BanExhausted` warning
    that says why (by default: what its rewinds could not avoid)."""
    if why is None:
        broken = [w.broken for w in row.history.watchers if w.broken]
        what = f"a value its schema forbids ({'; '.join(broken)})" if broken else "a banned phrase"
        why = f"it could not avoid {what} after {row.history.rewinds} rewinds"
    warnings.warn(f"row {r}: {why}; it ends with its longest clean prefix ({len(row.tokens)} tokens)",
                  BanExhausted, stacklevel=5)
    row.finished = False
    row.finish(Finish.BAN_EXHAUSTED)
