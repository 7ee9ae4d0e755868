"""What every generator is: a model, a sampler, an optional regex, and a parser for ``value``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from ..guides import build_index
from ..samplers import Greedy, Sampler

__all__ = ["SequenceGenerator"]


def _identity(text: str) -> Any:
    return text


@dataclass(frozen=True, eq=False)
class SequenceGenerator:
    """A sequence generator: wrap it with :func:`continuous.continuous` to call it.

    Attributes
    ----------
    model
        The backend.
    sampler
        How tokens are chosen (greedy by default).
    regex
        The constraint on the generated text, or ``None`` for free text.
    parse
        Turns one row's generated text into its ``value``.
    kind
        ``"text"``, ``"choice"``, ``"json"``, ``"regex"`` or ``"format"``.
    """

    model: Any
    sampler: Sampler = field(default_factory=Greedy)
    regex: str | None = None
    parse: Callable[[str], Any] = _identity
    kind: str = "text"
    index: Any = None

    def __post_init__(self):
        if not isinstance(self.sampler, Sampler):
            raise TypeError(f"sampler must come from continuous.samplers, got {type(self.sampler).__name__}")
        if self.regex is not None and self.index is None:
            # Build now: an invalid constraint fails here, not at the first call.
            object.__setattr__(self, "index", build_index(self.regex, self.model.tokenizer))


def make(model, sampler, regex=None, parse=_identity, kind="text") -> SequenceGenerator:
    """Build a generator, defaulting the sampler to greedy."""
    return SequenceGenerator(model, sampler if sampler is not None else Greedy(), regex, parse, kind)
