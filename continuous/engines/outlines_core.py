"""The outlines_core engine: regular expressions, and JSON Schema through its regex compiler.

A matcher is a small value: the current DFA state (an int) and the states before it, so
copying a row (beams, forks) copies a short list of ints instead of a ``Guide``, whose
``copy.copy`` serializes the whole ``Index``. Masks are built once per state from
``Index.get_allowed_tokens`` and kept, packed, in a bounded per-constraint LRU: a
decoding loop revisits the same few states (inside a string, between fields), so most
fills are a 4-byte-per-32-tokens copy.

The vocabulary conversion and the ``Index`` cache are those of :mod:`continuous.guides`.
"""

from __future__ import annotations

import collections
import json
import threading

import numpy as np
import torch

from ..guides import build_index, vocabulary
from .llguidance import fill_row, schema_text

__all__ = ["json_schema", "regex", "OutlinesCoreConstraint", "OutlinesCoreMatcher"]

#: The state a matcher enters when it consumes EOS: nothing may follow.
_ENDED = -1
#: Packed masks kept per constraint (16 KB each on a 128k vocabulary).
_MAX_MASKS = 1024
#: Forced tokens are followed at most this far per call, so a long literal is cut in pieces.
_MAX_FORCED = 256


class OutlinesCoreConstraint:
    """An ``Index`` over one tokenizer's vocabulary; makes :class:`OutlinesCoreMatcher` s."""

    engine = "outlines_core"

    def __init__(self, pattern: str | None, tokenizer, index=None):
        self.pattern = pattern
        # An outlines Generator brings its own Index (its pattern is not kept).
        self.index = index if index is not None else build_index(pattern, tokenizer)
        self.eos_token_id = vocabulary(tokenizer).get_eos_token_id()
        self.n_tokens = len(tokenizer)
        self.words = (self.n_tokens + 31) // 32
        self.initial = self.index.get_initial_state()
        self._lock = threading.Lock()
        self._masks: "collections.OrderedDict[int, torch.Tensor]" = collections.OrderedDict()
        self._allowed: dict[int, list[int]] = {}

    def matcher(self) -> "OutlinesCoreMatcher":
        return OutlinesCoreMatcher(self, [self.initial])

    def allowed(self, state: int) -> list[int]:
        """Token ids allowed after ``state`` other than EOS (sorted)."""
        if state == _ENDED:
            return []
        found = self._allowed.get(state)
        if found is None:
            found = sorted(t for t in (self.index.get_allowed_tokens(state) or ()) if t != self.eos_token_id)
            # Only short lists are kept: they are what forced() and done() look at.
            if len(found) <= 2:
                self._allowed[state] = found
        return found

    def mask(self, state: int) -> torch.Tensor:
        """The packed int32 mask of ``state`` (EOS set exactly in final states)."""
        with self._lock:
            hit = self._masks.get(state)
            if hit is not None:
                self._masks.move_to_end(state)
                return hit
        bits = np.zeros(self.words * 32, dtype=bool)
        if state != _ENDED:
            ids = np.asarray(self.allowed(state), dtype=np.int64)
            bits[ids[ids < self.n_tokens]] = True
            if self.index.is_final_state(state):
                bits[self.eos_token_id] = True
        packed = torch.from_numpy(np.packbits(bits, bitorder="little").view(np.int32).copy())
        with self._lock:
            self._masks[state] = packed
            while len(self._masks) > _MAX_MASKS:
                self._masks.popitem(last=False)
        return packed


class OutlinesCoreMatcher:
    """One row's position: the current state and every earlier one, for rollback."""

    __slots__ = ("_c", "_states")

    def __init__(self, constraint: OutlinesCoreConstraint, states: list[int]):
        self._c = constraint
        self._states = states

    def fill(self, bitmask: torch.Tensor) -> None:
        """Write the allowed next tokens (EOS exactly in a final state) into an int32 row."""
        mask = self._c.mask(self._states[-1])
        fill_row(bitmask, self._c.words, lambda row: row.copy_(mask))

    def advance(self, token_id: int) -> None:
        """Move past a token; ``ValueError`` (state unchanged) when it is not allowed."""
        state = self._states[-1]
        if state == _ENDED:
            raise ValueError(f"token {token_id} after EOS")
        if token_id == self._c.eos_token_id:
            if not self._c.index.is_final_state(state):
                raise ValueError("EOS before the text matches")
            self._states.append(_ENDED)
            return
        nxt = self._c.index.get_next_state(state, token_id)
        if nxt is None:
            raise ValueError(f"token {token_id} is not allowed here")
        self._states.append(nxt)

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` tokens (EOS included)."""
        if n < 0 or n >= len(self._states):
            raise ValueError(f"cannot roll back {n} tokens; {len(self._states) - 1} were consumed")
        if n:
            del self._states[-n:]

    def forced(self) -> list[int]:
        """The tokens that are the only choice, one after another, until a choice or a final state.

        In a final state EOS is also allowed, so forcing stops there. The tokens are the
        only path the index allows; when the tokenizer could spell the same text in two
        ways, both are allowed and nothing is forced.
        """
        out: list[int] = []
        state = self._states[-1]
        while len(out) < _MAX_FORCED and state != _ENDED and not self._c.index.is_final_state(state):
            allowed = self._c.allowed(state)
            if len(allowed) != 1:
                break
            out.append(allowed[0])
            state = self._c.index.get_next_state(state, allowed[0])
        return out

    def accepting(self) -> bool:
        state = self._states[-1]
        return state == _ENDED or self._c.index.is_final_state(state)

    def done(self) -> bool:
        state = self._states[-1]
        return state == _ENDED or (self._c.index.is_final_state(state) and not self._c.allowed(state))

    def copy(self) -> "OutlinesCoreMatcher":
        return OutlinesCoreMatcher(self._c, list(self._states))


_CONSTRAINTS: dict = {}
_LOCK = threading.Lock()


def regex(pattern: str, tokenizer) -> OutlinesCoreConstraint:
    """Text that matches a regular expression in full (outlines_core's regex syntax).

    Raises
    ------
    ValueError
        When the regex is invalid or no token sequence can match it.
    """
    # guides.build_index caches the Index; this caches the masks that go with it.
    key = (pattern, id(vocabulary(tokenizer)))
    with _LOCK:
        hit = _CONSTRAINTS.get(key)
    if hit is None:
        hit = OutlinesCoreConstraint(pattern, tokenizer)
        with _LOCK:
            hit = _CONSTRAINTS.setdefault(key, hit)
    return hit


def json_schema(schema, tokenizer, whitespace_pattern: str | None = None) -> OutlinesCoreConstraint:
    """A JSON document valid against a schema, through outlines_core's schema-to-regex compiler.

    Integer bounds and calendar dates are exact in the regex
    (:func:`continuous.generate.json.schema_regex`); keywords the compiler does not know
    (``not``, number bounds) are not enforced: ``generate.json`` checks them on ``.value``.

    Raises
    ------
    ValueError
        When the compiler refuses the schema or the regex cannot be indexed.
    """
    from ..generate.json import schema_regex

    pattern = schema_regex(json.loads(schema_text(schema)), whitespace_pattern)
    return regex(pattern, tokenizer)
