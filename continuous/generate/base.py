"""What every generator is: a model, a sampler, an optional regex, and a parser for ``value``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from .. import engines
from ..engines import check_engine
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
        ``"text"``, ``"choice"``, ``"json"``, ``"regex"``, ``"format"`` or ``"cfg"``.
    constraint
        The compiled :class:`~continuous.engines.Constraint` (``None``: free text).
    engine
        The constraint engine, ``"llguidance"`` or ``"outlines_core"``.
    ban
        The :class:`~continuous.ban.BanList` of ``ban=``, or ``None``.
    """

    model: Any
    sampler: Sampler = field(default_factory=Greedy)
    regex: str | None = None
    parse: Callable[[str], Any] = _identity
    kind: str = "text"
    constraint: Any = None
    engine: str | None = None
    ban: Any = None

    def __post_init__(self):
        if not isinstance(self.sampler, Sampler):
            raise TypeError(f"sampler must come from continuous.samplers, got {type(self.sampler).__name__}")
        if self.regex is not None and self.constraint is None:
            # Build now: an invalid constraint fails here, not at the first call.
            engine = check_engine(self.engine)
            object.__setattr__(self, "engine", engine)
            object.__setattr__(self, "constraint", engines.regex(self.regex, self.model.tokenizer, engine))
        if self.ban is not None and self.sampler.joint and self.sampler.samples > 1:
            raise ValueError("ban= does not work with beam search: a rewind would have to re-rank every beam; "
                             "use greedy or multinomial sampling")

    @property
    def index(self):
        """The outlines_core ``Index`` of the constraint (``None`` on another engine or for free text)."""
        return getattr(self.constraint, "index", None)


def check_model(model) -> None:
    """Refuse, when a generator is built, what is not a model of ``continuous.models``."""
    if isinstance(model, (str, bytes)) or not hasattr(model, "tokenizer"):
        raise TypeError(f"model must come from continuous.models (e.g. models.transformers(path)), "
                        f"got {type(model).__name__}{' ' + repr(model) if isinstance(model, str) else ''}")


def make(model, sampler, regex=None, parse=_identity, kind="text", *, engine=None, constraint=None, ban=None,
         ban_case=False) -> SequenceGenerator:
    """Build a generator, defaulting the sampler to greedy.

    Parameters
    ----------
    model
        A model from ``continuous.models``.
    sampler
        A sampler, or ``None`` for greedy.
    regex
        The constraint as a regular expression, or ``None``.
    parse
        Turns a whole match into the value (a row whose constraint was not complete when
        generation stopped raises ``ValueError`` on ``.value`` before any parsing).
    kind
        The generator's kind, for messages.
    engine
        ``"llguidance"``, ``"outlines_core"`` or ``None`` (the default engine).
    constraint
        An already compiled constraint (JSON schemas and grammars), instead of ``regex``.
    ban, ban_case
        Banned phrases and patterns, and whether phrases match case (see :mod:`continuous.ban`).
    """
    check_model(model)
    bans = None
    if ban is not None:
        from ..ban import BanList

        bans = BanList(ban, case_sensitive=ban_case)
    return SequenceGenerator(model, sampler if sampler is not None else Greedy(), regex, parse, kind,
                             constraint, engine, bans)
