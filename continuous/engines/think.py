"""A thinking section before a constraint: free text up to a closing marker, then the constraint.

:class:`ThinkConstraint` wraps any constraint (or free text). Its matcher first follows a
small llguidance grammar, any text ending at the first closing marker (a token that
would run past the marker is not allowed, so the section ends on a token boundary), then
hands every later token to the wrapped constraint's matcher. With a budget, once that
many tokens were thought the only token allowed is the next of the closing marker's:
a single allowed token, which the decoding loop forwards with the step that sampled
the last thought (fast-forward), with nothing recomputed.
"""

from __future__ import annotations

import bisect
import json
from typing import Sequence

import torch

from ..think import inside, turn_tokens
from . import Match, bits
from .llguidance import lark

__all__ = ["ThinkConstraint", "ThinkMatcher", "ThinkWatch"]


def _special_id(tokenizer, text: str) -> int | None:
    """The id of ``text`` when it is one special token of the tokenizer."""
    for token_id, token in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if token.content == text and token.special:
            return token_id
    return None


def _section_grammar(tokenizer, close: str) -> str:
    """Any text, then ``close``: a special token, or text that ends the section at its first occurrence."""
    special = _special_id(tokenizer, close)
    if special is not None:
        return f"start: THOUGHT <[{special}]>\nTHOUGHT: /(?s:.*)/\n"
    return f"start: thought\nthought[suffix={json.dumps(close)}]: /(?s:.*)/\n"


class ThinkConstraint:
    """A thinking section ending with ``think.close``, then ``inner`` (``None``: free text).

    Parameters
    ----------
    inner
        The generator's own compiled constraint, or ``None``.
    tokenizer
        The model's HF tokenizer.
    think
        The :class:`~continuous.think.Think` (markers and budget).
    """

    def __init__(self, inner, tokenizer, think):
        self.inner, self.think = inner, think
        self.stops = turn_tokens(tokenizer, think)  # a section never runs across these
        self.section = lark(_section_grammar(tokenizer, think.close), tokenizer)
        self.close_ids = tuple(tokenizer.encode(think.close, add_special_tokens=False))
        self.n_tokens, self.eos = len(tokenizer), tokenizer.eos_token_id
        self.engine = inner.engine if inner is not None else self.section.engine
        self.dropped = inner.dropped if inner is not None else frozenset()

    def matcher(self) -> "ThinkMatcher":
        inner = self.inner.matcher() if self.inner is not None else None
        return ThinkMatcher(self, self.section.matcher(), inner)

    def resume(self, ids: Sequence[int], text: str, ends: Sequence[int]) -> "ThinkMatcher":
        """The matcher of a row that a call continues: its tokens ``ids``, ending at the
        characters ``ends`` of its text ``text``.

        A row inside a thinking section (a state cut while it thought, a prompt that began
        the thoughts) goes on with it: the tokens after its opening marker are the
        section's so far, and count against the budget.
        """
        matcher = self.matcher()
        start = inside(text, self.think, self.stops)
        if start is not None:
            for token_id in ids[bisect.bisect_right(ends, start):]:
                matcher.advance(token_id)
        return matcher

    def watch(self):
        """The wrapped constraint's watch, fed only the text after the thinking section."""
        if self.inner is None or self.inner.watch() is None:
            return None
        return ThinkWatch(self.inner.watch, self.think.close)


class ThinkMatcher:
    """One row: the thinking section's matcher, then the wrapped constraint's."""

    def __init__(self, constraint: ThinkConstraint, section, inner, phases: list[bool] | None = None,
                 closing_at: int | None = None):
        self.c, self.section, self.inner = constraint, section, inner
        self.phases = phases if phases is not None else []  # per token: True when it was part of the answer
        self.closing_at = closing_at  # the token count where the budget began writing the closing marker

    @property
    def thinking(self) -> bool:
        return not self.section.accepting()

    def _closing(self) -> int | None:
        """Which token of the closing marker the budget writes next (``None``: the model chooses)."""
        if self.closing_at is None:
            return None
        at = len(self.phases) - self.closing_at
        return at if at < len(self.c.close_ids) else None

    def fill(self, bitmask: torch.Tensor) -> None:
        if not self.thinking:
            if self.inner is not None:
                self.inner.fill(bitmask)
            else:
                bits.pack(None, bitmask, self.c.n_tokens)
            return
        if self._closing() is None:
            self.section.fill(bitmask)  # its EOS bit is clear: the section is not complete
            budget, spent = self.c.think.budget, len(self.phases)  # every token so far was thought
            # The marker starts on a character boundary: after a token that ends inside a
            # character (byte-level vocabularies), the model's own tokens complete it first.
            if budget is None or spent < budget or not bits.has(bitmask, self.c.close_ids[0]):
                return
            self.closing_at = spent
        bits.pack([self.c.close_ids[self._closing()]], bitmask, self.c.n_tokens)

    def advance(self, token_id: int) -> None:
        answer = not self.thinking
        if answer:
            if self.inner is not None:
                self.inner.advance(token_id)
        else:
            at = self._closing()
            if at is not None and token_id != self.c.close_ids[at]:
                raise ValueError(f"token {token_id} is not allowed here: the thinking budget is spent")
            self.section.advance(token_id)
        self.phases.append(answer)

    def rollback(self, n: int) -> None:
        if n < 0:
            raise ValueError("cannot roll back a negative number of tokens")
        undone = self.phases[len(self.phases) - n:] if n else []
        answer = sum(undone)
        if answer and self.inner is not None:
            self.inner.rollback(answer)
        if n - answer:
            self.section.rollback(n - answer)
        del self.phases[len(self.phases) - n:]
        if self.closing_at is not None and self.closing_at > len(self.phases):
            self.closing_at = None

    def forced(self) -> list[int]:
        if self.thinking:
            at = self._closing()
            return [] if at is None else list(self.c.close_ids[at:])
        return self.inner.forced() if self.inner is not None else []

    def accepting(self) -> bool:
        return not self.thinking and (self.inner is None or self.inner.accepting())

    def done(self) -> bool:
        return not self.thinking and self.inner is not None and self.inner.done()

    def copy(self) -> "ThinkMatcher":
        inner = self.inner.copy() if self.inner is not None else None
        return ThinkMatcher(self.c, self.section.copy(), inner, list(self.phases), self.closing_at)


class ThinkWatch:
    """A constraint's watch that sees only the text after the closing marker.

    A :class:`~continuous.engines.Watch`; the matches it reports are placed in the whole text.
    """

    def __init__(self, make_inner, close: str):
        self.make_inner, self.close = make_inner, close
        self.text, self.offset, self.inner = "", None, None

    def _shifted(self, matches) -> list[Match]:
        return [m.shifted(self.offset) for m in matches]

    def feed(self, piece: str) -> list[Match]:
        self.text += piece
        if self.inner is None:
            at = self.text.find(self.close)
            if at < 0:
                return []
            self.offset, self.inner = at + len(self.close), self.make_inner()
            piece = self.text[self.offset:]
        return self._shifted(self.inner.feed(piece)) if piece else []

    def finish(self) -> list[Match]:
        return self._shifted(self.inner.finish()) if self.inner is not None else []

    def held(self) -> int:
        return self.inner.held() if self.inner is not None else 0

    def rewind(self, length: int) -> None:
        self.text = self.text[:length]
        if self.inner is not None and length < self.offset:
            self.offset, self.inner = None, None
        elif self.inner is not None:
            self.inner.rewind(length - self.offset)

    @property
    def broken(self):
        return self.inner.broken if self.inner is not None else None

    def copy(self) -> "ThinkWatch":
        new = ThinkWatch(self.make_inner, self.close)
        new.text, new.offset = self.text, self.offset
        new.inner = self.inner.copy() if self.inner is not None else None
        return new
