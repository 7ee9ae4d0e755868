"""Constraint engines: compiled constraints and per-row matchers.

A :class:`Constraint` is compiled once per (grammar, tokenizer) and shared (threads
included); it only makes matchers. A :class:`Matcher` is one row's state: it writes
the row's allowed tokens into a packed int32 bitmask row (:mod:`.bits`), advances past a
token, rolls back, and copies cheaply, which is what beams, forks, slices and
backtracking need.

Engines: ``llguidance`` (regular expressions, JSON Schema, Lark grammars) and
``outlines_core`` (regular expressions, JSON Schema through its regex compiler). Build a
constraint with :func:`json_schema`, :func:`regex` or :func:`grammar`; what each engine
needs of a schema is prepared inside it, and what it compiles is cached by one policy
(:mod:`.caches`).
"""

from __future__ import annotations

import importlib
import warnings
from dataclasses import dataclass
from typing import Protocol

import torch

__all__ = ["Constraint", "Matcher", "fill_rows", "Watch", "Match", "ENGINES", "DEFAULT_ENGINE", "EngineFallbackWarning",
           "check_engine", "json_schema", "regex", "grammar"]

#: The engine names ``engine=`` accepts.
ENGINES = ("llguidance", "outlines_core")
#: The engine used when ``engine=None``: on MaskBench it compiles more schemas, accepts
#: no invalid instance and compiles in milliseconds (docs/constraints.md).
DEFAULT_ENGINE = "llguidance"


def check_engine(engine: str | None) -> str:
    """The engine an ``engine=`` argument names (``None``: :data:`DEFAULT_ENGINE`)."""
    if engine is None:
        return DEFAULT_ENGINE
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    return engine


def _engine(engine: str | None):
    # Imported on first use: each engine loads its own native library.
    return importlib.import_module(f"{__name__}.{check_engine(engine)}")


def json_schema(schema, tokenizer, *, engine: str | None = None, whitespace_pattern: str | None = None
                ) -> "Constraint":
    """The constraint of a JSON document valid against ``schema`` (a dict, bool or JSON text).

    On ``engine="outlines_core"``, a schema that engine would serve as a narrower language
    (or compile for minutes) is served by llguidance, with an :class:`EngineFallbackWarning`.

    Raises
    ------
    ValueError
        When the schema is invalid or the engine refuses it, with the reason.
    """
    if check_engine(engine) == "outlines_core":
        from .outlines_core import unserved_schema

        engine = _fallback(unserved_schema(schema, tokenizer, whitespace_pattern))
    return _engine(engine).json_schema(schema, tokenizer, whitespace_pattern)


def regex(pattern: str, tokenizer, *, engine: str | None = None) -> "Constraint":
    """The constraint of text that matches a regular expression in full.

    On ``engine="outlines_core"``, a regex that engine would serve as a narrower language
    is served by llguidance, with an :class:`EngineFallbackWarning`.
    """
    if check_engine(engine) == "outlines_core":
        from .outlines_core import unserved_regex

        engine = _fallback(unserved_regex(pattern, tokenizer))
    return _engine(engine).regex(pattern, tokenizer)


def _fallback(reason: str | None) -> str:
    if reason is None:
        return "outlines_core"
    warnings.warn(f"outlines_core cannot serve this constraint exactly ({reason}): llguidance serves it",
                  EngineFallbackWarning, stacklevel=4)
    return "llguidance"


class EngineFallbackWarning(UserWarning):
    """The engine asked for would serve a constraint wrong: another engine serves it."""


def grammar(lark: str, tokenizer) -> "Constraint":
    """The constraint of text in a Lark grammar's language (llguidance's dialect)."""
    return _engine("llguidance").lark(lark, tokenizer)


def fill_rows(matchers: list["Matcher"], out: torch.Tensor) -> None:
    """:meth:`Matcher.fill` of each matcher into its row of ``out`` (``[n, words]`` int32, CPU,
    contiguous). Matchers of an engine that fills many rows at once (a ``fill_many`` static
    method: llguidance's thread pool) do so together; the others one row at a time."""
    groups: dict = {}
    for i, m in enumerate(matchers):
        groups.setdefault(getattr(type(m), "fill_many", None), []).append(i)
    for fill_many, rows in groups.items():
        if fill_many is None:
            for i in rows:
                matchers[i].fill(out[i])
        elif len(rows) == len(matchers):
            fill_many(matchers, out)
        else:
            block = out.new_empty((len(rows), out.shape[1]))
            fill_many([matchers[i] for i in rows], block)
            out[rows] = block


class Matcher(Protocol):
    """One row's position in a constraint."""

    def fill(self, bitmask: torch.Tensor) -> None:
        """Write the tokens allowed next into ``bitmask``, an int32 CPU row of ``ceil(vocab / 32)`` words.

        Bit ``t % 32`` of word ``t // 32`` is 1 when token ``t`` is allowed; EOS is allowed
        exactly when the text so far is a complete match.
        """

    def advance(self, token_id: int) -> None:
        """Move past a token the mask allowed (``ValueError`` for a forbidden one)."""

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` tokens."""

    def forced(self) -> list[int]:
        """Tokens the constraint forces from here, in order (empty when there is a choice)."""

    def accepting(self) -> bool:
        """Whether the text so far is a complete match."""

    def done(self) -> bool:
        """Whether nothing but EOS may follow."""

    def copy(self) -> "Matcher":
        """An independent matcher at the same position."""


class Constraint(Protocol):
    """A compiled constraint over one tokenizer's vocabulary."""

    #: The engine's name (one of :data:`ENGINES`).
    engine: str
    #: Keywords of a JSON schema its grammar does not enforce (its :meth:`watch` does).
    dropped: frozenset[str]

    def matcher(self) -> Matcher:
        """A matcher at the start of the constraint."""

    def watch(self) -> "Watch | None":
        """What watches a row's text for what the grammar could not enforce (``None``: nothing)."""


@dataclass(frozen=True)
class Match:
    """Text a :class:`Watch` found in a row that the row must not keep: it rewinds.

    Attributes
    ----------
    start, end
        The match's characters in the watched text (``end`` excluded).
    factor
        0 forbids the token the rewind goes back to, at its position; a factor in
        ``(0, 1]`` multiplies its probability there (a soft ban).
    value
        A value its schema forbids: the rewind goes back to the first token the row
        chose within it (that choice decided the value). Otherwise a phrase: back to
        the token where it starts.
    """

    start: int
    end: int
    factor: float = 0.0
    value: bool = False

    def shifted(self, by: int) -> "Match":
        """The same match in a text that has ``by`` more characters before it."""
        return Match(self.start + by, self.end + by, self.factor, self.value)


class Watch(Protocol):
    """What follows one row's generated text for matches to rewind on: a ban list's matcher,
    or a relaxed JSON schema's watch over what its grammar does not enforce."""

    #: What the last match broke, in words, for the warning when a row gives up (``None``:
    #: a banned phrase).
    broken: str | None

    def feed(self, piece: str) -> list[Match]:
        """Add text; return the matches it completes, earliest first."""

    def finish(self) -> list[Match]:
        """The matches that the end of the text completes (what waited for what follows)."""

    def held(self) -> int:
        """Trailing characters a later match could still take back (a stream holds them)."""

    def rewind(self, length: int) -> None:
        """Go back to the first ``length`` characters fed."""

    def copy(self) -> "Watch":
        """An independent watch at the same place."""
