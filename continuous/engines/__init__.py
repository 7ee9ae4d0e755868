"""Constraint engines: compiled constraints and per-row matchers.

A :class:`Constraint` is compiled once per (grammar, tokenizer) and shared (threads
included); it only makes matchers. A :class:`Matcher` is one row's state: it writes
the row's allowed tokens into a packed int32 bitmask row, advances past a token, rolls
back, and copies cheaply, which is what beams, forks, slices and backtracking need.

Engines: ``outlines_core`` (regular expressions, JSON Schema through its regex
compiler) and ``llguidance`` (regular expressions, JSON Schema, Lark grammars).
"""

from __future__ import annotations

from typing import Protocol

import torch

__all__ = ["Constraint", "Matcher", "ENGINES", "DEFAULT_ENGINE", "check_engine", "regex"]

#: The engine names ``engine=`` accepts.
ENGINES = ("llguidance", "outlines_core")
#: The engine generators use when ``engine=None``: on MaskBench it compiles more schemas,
#: accepts no invalid instance and compiles in milliseconds (docs/constraints.md).
DEFAULT_ENGINE = "llguidance"


def check_engine(engine: str | None) -> str:
    """The engine an ``engine=`` argument names (``None``: :data:`DEFAULT_ENGINE`)."""
    if engine is None:
        return DEFAULT_ENGINE
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    return engine


def regex(pattern: str, tokenizer, engine: str | None = None) -> "Constraint":
    """The constraint of a regular expression on the given engine."""
    if check_engine(engine) == "llguidance":
        from .llguidance import regex as build
    else:
        from .outlines_core import regex as build
    return build(pattern, tokenizer)


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

    engine: str

    def matcher(self) -> Matcher:
        """A matcher at the start of the constraint."""
