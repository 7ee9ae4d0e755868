import re
from dataclasses import replace

from .. import engines
from ..scores import ChoiceScorer
from .base import SequenceGenerator, make
from .types import choices_of


def choice(model, choices, sampler=None, *, scores=False, engine=None, ban=None, ban_case=False, think=None
           ) -> SequenceGenerator:
    """One of the given strings; ``value`` is the chosen string (or Enum member, or Literal value).

    Parameters
    ----------
    choices
        A list of strings, an ``Enum`` class (its members' values are the choices), a
        ``Literal[...]`` or an ``outlines.types.Choice``.
    scores
        ``True``: before generating, compute every option's log-probability under the model
        after the prompt (the sum over its tokens' log-softmax) into
        :attr:`SequenceState.choice_scores`, keyed like ``value``; ``"mean"``: divided by
        the option's number of tokens. The prompt is forwarded once and the options
        together in one batched forward (see :mod:`continuous.scores`); the chosen option
        is the same as without scores.
    engine
        ``"llguidance"`` (the default) or ``"outlines_core"``.
    ban, ban_case, think
        As for every generator (:func:`~continuous.generate.text`).
    """
    members = choices_of(choices)
    if members is not None:
        parse = members.__getitem__
    else:
        # A generator or set would be consumed or unordered: ask for a sequence.
        if not isinstance(choices, (list, tuple)) or not all(isinstance(c, str) for c in choices):
            raise TypeError(f"choices must be a list (or tuple) of strings, an Enum class, a Literal or an "
                            f"outlines.types.Choice, got {type(choices).__name__}")
        members = {c: c for c in choices}
        parse = str
    if not members:
        raise ValueError("choice needs at least one choice (the list or Enum is empty)")
    scorer = _scorer(members, scores)
    if scorer is not None and think is not None:
        raise ValueError("scores= gives each option's probability right after the prompt; with think= the "
                         "answer follows a thinking section: use one or the other")
    pattern = "(" + "|".join(re.escape(c) for c in members) + ")"
    constraint = lambda tokenizer: engines.regex(pattern, tokenizer, engine=engine)  # noqa: E731
    made = make(model, sampler, constraint, parse, kind="choice", ban=ban, ban_case=ban_case, think=think)
    return replace(made, scorer=scorer)


def _scorer(members: dict, scores) -> ChoiceScorer | None:
    if scores is False or scores is None:
        return None
    if scores is not True and scores != "mean":
        raise ValueError(f"scores must be True (summed log-probabilities), \"mean\" (per token) or False, "
                         f"got {scores!r}")
    return ChoiceScorer(members, mean=scores == "mean")
