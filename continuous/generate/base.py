"""What every generator is: a model, a sampler, an optional regex, and a parser for ``value``."""

from __future__ import annotations

import re
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


class _Complete:
    """A parser that first checks the text is a whole match of the constraint.

    A row cut short (``max_tokens``, a stop string, the end of the context) holds a
    prefix of a match; parsing it anyway would give a wrong value (``'T'`` read as
    ``False``, ``'al'`` for ``'alpha'``), so ``.value`` raises instead.
    """

    def __init__(self, pattern: str, parse: Callable[[str], Any], kind: str):
        try:
            self.compiled = re.compile(pattern)
        except re.error:
            # outlines_core's dialect (Rust regex) accepts a few patterns Python's
            # ``re`` does not; the parser is then the only check.
            self.compiled = None
        self.parse, self.kind = parse, kind

    def __call__(self, text: str) -> Any:
        if self.compiled is not None and self.compiled.fullmatch(text) is None:
            raise ValueError(f"the {self.kind} constraint is not complete in {text!r}: the generation "
                             "was cut short (max_tokens, a stop string or the end of the context)")
        return self.parse(text)


def check_model(model) -> None:
    """Refuse, when a generator is built, what is not a model of ``continuous.models``."""
    if isinstance(model, (str, bytes)) or not hasattr(model, "tokenizer"):
        raise TypeError(f"model must come from continuous.models (e.g. models.transformers(path)), "
                        f"got {type(model).__name__}{' ' + repr(model) if isinstance(model, str) else ''}")


def make(model, sampler, regex=None, parse=_identity, kind="text") -> SequenceGenerator:
    """Build a generator, defaulting the sampler to greedy.

    Parameters
    ----------
    model
        A model from ``continuous.models``.
    sampler
        A sampler, or ``None`` for greedy.
    regex
        The constraint, or ``None`` for free text.
    parse
        Turns a whole match of ``regex`` into the value; a text that is not a whole
        match raises ``ValueError`` on ``.value``.
    kind
        The generator's kind, for messages.
    """
    check_model(model)
    if regex is not None:
        parse = _Complete(regex, parse, kind)
    return SequenceGenerator(model, sampler if sampler is not None else Greedy(), regex, parse, kind)
