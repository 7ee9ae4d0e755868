"""The outlines_core engine: regular expressions, and JSON Schema through its regex compiler.

A tokenizer's ``Vocabulary`` is converted once and each regex compiled into an
``Index`` once (:mod:`continuous.engines.caches`). A matcher is a small value: the
current DFA state (an int) and the states before it, so copying a row (beams, forks)
copies a short list of ints instead of a ``Guide``, whose ``copy.copy`` serializes the
whole ``Index``. Masks are built once per state from ``Index.get_allowed_tokens`` and kept,
packed, in a bounded per-constraint LRU: a decoding loop revisits the same few states
(inside a string, between fields), so most fills are a 4-byte-per-32-tokens copy.
"""

from __future__ import annotations

import copy
import re

import interegular
import torch
from outlines_core import Index, Vocabulary

from . import bits, caches, schema
from .schema_regex import schema_regex

__all__ = ["json_schema", "regex", "from_index", "vocabulary", "unserved_regex", "unserved_schema",
           "OutlinesCoreConstraint", "OutlinesCoreMatcher"]

#: The state a matcher enters when it consumes EOS: nothing may follow.
_ENDED = -1
#: Packed masks kept per constraint (16 KB each on a 128k vocabulary).
_MAX_MASKS = 1024
#: Forced tokens are followed at most this far per call, so a long literal is cut in pieces.
_MAX_FORCED = 256


def vocabulary(tokenizer) -> Vocabulary:
    """The outlines_core ``Vocabulary`` of a HF tokenizer, converted once per tokenizer."""
    return caches.derived(tokenizer, "outlines_core vocabulary", lambda: _convert(tokenizer))


def _convert(tokenizer) -> Vocabulary:
    from outlines.backends.outlines_core import OutlinesCoreBackend
    from outlines.models.transformers import TransformerTokenizer

    if tokenizer.eos_token_id is None:
        raise ValueError("constrained generation needs a tokenizer with an EOS token")
    # TransformerTokenizer sets a pad token on the tokenizer it wraps; give it a copy.
    adapter = TransformerTokenizer(copy.copy(tokenizer))
    return OutlinesCoreBackend.create_outlines_core_vocabulary(
        adapter.get_vocab(), adapter.eos_token_id, adapter.eos_token, adapter.convert_token_to_string)


class OutlinesCoreConstraint:
    """An ``Index`` over one tokenizer's vocabulary; makes :class:`OutlinesCoreMatcher` s."""

    engine = "outlines_core"
    dropped: frozenset[str] = frozenset()  # the regex is the whole language

    def __init__(self, index: Index, n_tokens: int, eos_token_id: int, pattern: str | None = None):
        self.pattern = pattern  # an outlines Generator brings its Index without its pattern
        self.index = index
        self.eos_token_id = eos_token_id
        self.n_tokens = n_tokens
        self.words = bits.words(n_tokens)
        self.initial = index.get_initial_state()
        self._masks = caches.LRU(_MAX_MASKS)
        self._allowed: dict[int, list[int]] = {}

    def matcher(self) -> "OutlinesCoreMatcher":
        return OutlinesCoreMatcher(self, [self.initial])

    def watch(self) -> None:
        return None  # the regex is the whole language

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
        return self._masks.get(state, lambda: self._pack(state))

    def _pack(self, state: int) -> torch.Tensor:
        ids = [t for t in self.allowed(state) if t < self.n_tokens]
        if state != _ENDED and self.index.is_final_state(state):
            ids.append(self.eos_token_id)
        row = torch.empty(self.words, dtype=torch.int32)
        bits.pack(ids, row, self.n_tokens)
        return row


class OutlinesCoreMatcher:
    """One row's position: the current state and every earlier one, for rollback."""

    __slots__ = ("_c", "_states")

    def __init__(self, constraint: OutlinesCoreConstraint, states: list[int]):
        self._c = constraint
        self._states = states

    def fill(self, bitmask: torch.Tensor) -> None:
        """Write the allowed next tokens (EOS exactly in a final state) into an int32 row."""
        mask = self._c.mask(self._states[-1])
        bits.fill_row(bitmask, self._c.words, lambda row: row.copy_(mask))

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


def regex(pattern: str, tokenizer) -> OutlinesCoreConstraint:
    """Text that matches a regular expression in full (outlines_core's regex syntax).

    Raises
    ------
    ValueError
        When the regex is invalid or no token sequence can match it.
    """
    return caches.compiled(tokenizer, ("outlines_core regex", pattern), lambda: _compile(pattern, tokenizer))


def _compile(pattern: str, tokenizer) -> OutlinesCoreConstraint:
    vocab = vocabulary(tokenizer)
    try:
        index = Index(pattern, vocab)
    except Exception as exc:  # outlines_core raises plain ValueError/RuntimeError
        raise ValueError(f"cannot build a constraint from regex {pattern!r}: {exc}") from exc
    return OutlinesCoreConstraint(index, len(tokenizer), vocab.get_eos_token_id(), pattern)


def from_index(index: Index, tokenizer) -> OutlinesCoreConstraint:
    """The constraint of an ``Index`` built elsewhere (an outlines ``Generator``'s)."""
    return OutlinesCoreConstraint(index, len(tokenizer), vocabulary(tokenizer).get_eos_token_id())


def json_schema(document, tokenizer, whitespace_pattern: str | None = None) -> OutlinesCoreConstraint:
    """A JSON document valid against a schema, through outlines_core's schema-to-regex compiler.

    Integer bounds and calendar dates are exact in the regex
    (:func:`~continuous.engines.schema_regex.schema_regex`); keywords the compiler does not
    know (``not``, number bounds) are not enforced: ``generate.json`` checks them on ``.value``.

    Raises
    ------
    ValueError
        When the compiler refuses the schema or the regex cannot be indexed.
    """
    return regex(schema_regex(schema.document(document), whitespace_pattern), tokenizer)


# ---------------------------------------------------------------------- what it cannot serve
# outlines_core would build a narrower language, or take minutes, on these: the caller
# routes them to another engine rather than serve them wrong.

_PLAIN_NAME = re.compile(r"[A-Za-z0-9_ -]*")
_ANY_CHAR = re.compile(r"\[\^|(?<!\\)\.|\\[WSD]|[^\x00-\x7f]")


def unserved_regex(pattern: str, tokenizer) -> str | None:
    """Why outlines_core cannot serve a regex exactly over this tokenizer (``None``: it can).

    Its ``Index`` leaves out, from a state where a match is complete, the tokens that lead
    on to a longer match (``cat|category`` would never give ``category``); and over a
    byte-level vocabulary it has no token for the pieces of a character that tokens split
    (an emoji on Llama 3).
    """
    try:
        fsm = interegular.parse_pattern(pattern).to_fsm()
    except Exception:  # a syntax interegular does not read: outlines_core judges it
        return None
    finals = fsm.finals
    if any(nxt not in finals for state in finals for nxt in fsm.map.get(state, {}).values()):
        return "a match may go on after a complete one, which its index leaves out"
    if _byte_level(tokenizer) and _ANY_CHAR.search(pattern):
        return "a byte-level vocabulary cannot spell there characters that tokens split"
    return None


def _byte_level(tokenizer) -> bool:
    decoder = getattr(tokenizer, "backend_tokenizer", None)
    return decoder is not None and type(decoder.decoder).__name__ == "ByteLevel"


def unserved_schema(document, tokenizer, whitespace_pattern: str | None = None) -> str | None:
    """Why outlines_core cannot serve a JSON schema exactly over this tokenizer (``None``: it can)."""
    document = schema.document(document)
    found: list[str] = []

    def check(node):
        if not isinstance(node, dict):
            return node
        if "allOf" in node and "properties" in node:
            found.append("allOf beside properties is dropped by its compiler")
        names = list(node.get("properties", {}))
        for value in [node.get("const"), *node.get("enum", ())]:
            if isinstance(value, dict):
                names += list(value)
        if any(not _PLAIN_NAME.fullmatch(str(name)) for name in names):
            found.append("property names with special characters are not escaped by its compiler")
        if node.get("type") == "object" and node.get("additionalProperties") is not False:
            found.append("its objects take no property beyond those listed, where the schema allows more")
        if not set(node) - _ANNOTATIONS:
            found.append("a value of any kind takes its compiler minutes")
        return node

    if document is True or document == {}:
        return "a value of any kind takes its compiler minutes"
    schema.rewritten(document, check)
    if found:
        return found[0]
    try:
        return unserved_regex(schema_regex(document, whitespace_pattern), tokenizer)
    except ValueError:
        return None  # the compiler refuses it, and says why


#: Keywords that say nothing of a value: a schema of only these takes any JSON value.
_ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$comment", "$schema", "$id"})
