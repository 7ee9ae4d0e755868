"""What every generator is: a model, a sampler, a compiled constraint, and a parser for ``value``."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

from ..ban import BanList
from ..decode.options import check_rewinds
from ..models.base import Model
from ..samplers import Greedy, Sampler
from ..think import Answer, Tagger, Think, opened, thinking

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
        ``"text"``, ``"choice"``, ``"json"``, ``"regex"``, ``"format"``, ``"cfg"`` or ``"tools"``.
    ban
        The :class:`~continuous.ban.BanList` of ``ban=``, or ``None``.
    think
        The :class:`~continuous.think.Think` section before the constraint, or ``None``.
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
    think: Think | None = None
    scorer: Any = None

    def __post_init__(self):
        if not isinstance(self.sampler, Sampler):
            raise TypeError(f"sampler must come from continuous.samplers, got {type(self.sampler).__name__}")
        check_rewinds(self.sampler, self.ban, self.constraint)

    @property
    def engine(self) -> str | None:
        """The constraint's engine (``None`` for free text)."""
        return self.constraint.engine if self.constraint is not None else None

    def opened(self, prompt):
        """The prompt of a call, with the thinking section's opening marker where it is missing."""
        return prompt if self.think is None else opened(prompt, self.think, self.constraint.stops)

    def tagger(self):
        """What makes a call's streamed pieces say which part they are (identity without thinking)."""
        return list if self.think is None else Tagger(self.think.close)


def check_model(model) -> None:
    """Refuse, when a generator is built, what is not a model of ``continuous.models``."""
    if not isinstance(model, Model):
        raise TypeError(f"model must come from continuous.models (e.g. models.transformers(path)), "
                        f"got {type(model).__name__}{' ' + repr(model) if isinstance(model, str) else ''}")


def make(model, sampler, constraint=None, parse=_identity, kind="text", *, ban=None, ban_case=False, think=None
         ) -> SequenceGenerator:
    """Build a generator: check the model, compile its constraint, add the thinking section.

    Parameters
    ----------
    constraint
        The compiled constraint, or a function of the model's tokenizer that compiles it
        (called once the model is known to be one), or ``None`` for free text.
    ban, ban_case
        The phrases and patterns the output may not contain, and whether phrases match
        case (see :mod:`continuous.ban`).
    think
        ``None``, ``True``, a token budget or a :class:`~continuous.think.Think`: a thinking
        section of free text before the constraint (see :mod:`continuous.think`).
    """
    check_model(model)
    if callable(constraint) and not hasattr(constraint, "matcher"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            constraint = constraint(model.tokenizer)
        for warning in caught:  # said where the user built the generator, two frames up
            warnings.warn(warning.message, warning.category, stacklevel=3)
    bans = BanList(ban, case_sensitive=ban_case) if ban is not None else None
    think = thinking(think, model.tokenizer)
    if think is not None:
        from ..engines.think import ThinkConstraint

        constraint, parse = ThinkConstraint(constraint, model.tokenizer, think), Answer(parse, think.close)
    return SequenceGenerator(model, sampler if sampler is not None else Greedy(), constraint, parse, kind, bans,
                             think)
