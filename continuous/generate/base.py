"""What every generator is: a model, a sampler, a compiled constraint, and a parser for ``value``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from ..ban import BanList
from ..models.base import Model
from ..samplers import Greedy, Sampler

__all__ = ["SequenceGenerator", "make"]


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
    constraint
        The compiled :class:`~continuous.engines.Constraint` of the generated text, or
        ``None`` for free text.
    parse
        Turns one row's generated text into its ``value``.
    kind
        ``"text"``, ``"choice"``, ``"json"``, ``"regex"``, ``"format"`` or ``"cfg"``.
    ban
        The :class:`~continuous.ban.BanList` of ``ban=``, or ``None``.
    scorer
        For ``choice(..., scores=...)``: the :class:`~continuous.scores.ChoiceScorer` run on
        the prompt before generating, or ``None``.
    """

    model: Any
    sampler: Sampler = field(default_factory=Greedy)
    constraint: Any = None
    parse: Callable[[str], Any] = _identity
    kind: str = "text"
    ban: BanList | None = None
    scorer: Any = None

    def __post_init__(self):
        if not isinstance(self.sampler, Sampler):
            raise TypeError(f"sampler must come from continuous.samplers, got {type(self.sampler).__name__}")
        if self.ban is not None and self.sampler.joint and self.sampler.samples > 1:
            raise ValueError("ban= does not work with beam search: a rewind would have to re-rank every beam; "
                             "use greedy or multinomial sampling")

    @property
    def engine(self) -> str | None:
        """The constraint's engine (``None`` for free text)."""
        return self.constraint.engine if self.constraint is not None else None


def check_model(model) -> None:
    """Refuse, when a generator is built, what is not a model of ``continuous.models``."""
    if not isinstance(model, Model):
        raise TypeError(f"model must come from continuous.models (e.g. models.transformers(path)), "
                        f"got {type(model).__name__}{' ' + repr(model) if isinstance(model, str) else ''}")


def make(model, sampler, constraint=None, parse=_identity, kind="text", *, ban=None, ban_case=False
         ) -> SequenceGenerator:
    """Build a generator from its compiled constraint, defaulting the sampler to greedy.

    ``ban`` and ``ban_case`` are the phrases and patterns the output may not contain,
    and whether phrases match case (see :mod:`continuous.ban`).
    """
    check_model(model)
    bans = BanList(ban, case_sensitive=ban_case) if ban is not None else None
    return SequenceGenerator(model, sampler if sampler is not None else Greedy(), constraint, parse, kind, bans)
