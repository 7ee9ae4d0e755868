import re

from .. import engines
from .base import SequenceGenerator, make
from .types import choices_of


def choice(model, choices, sampler=None, *, engine=None, ban=None, ban_case=False, think=None) -> SequenceGenerator:
    """One of the given strings; ``value`` is the chosen string (or Enum member, or Literal value).

    Parameters
    ----------
    choices
        A list of strings, an ``Enum`` class (its members' values are the choices), a
        ``Literal[...]`` or an ``outlines.types.Choice``.
    engine
        The constraint engine: ``"llguidance"`` (the default) or ``"outlines_core"``.
    ban, ban_case
        Phrases and ``regex`` patterns the output may not contain (a dict phrase ->
        factor for soft bans), and whether phrases match case (:mod:`continuous.ban`).
    think
        A thinking section of free text before the constraint: ``True`` (the model's own
        markers), an int (a token budget) or a :class:`~continuous.Think` (:mod:`continuous.think`).
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
    pattern = "(" + "|".join(re.escape(c) for c in members) + ")"
    constraint = lambda tokenizer: engines.regex(pattern, tokenizer, engine=engine)  # noqa: E731
    return make(model, sampler, constraint, parse, kind="choice", ban=ban, ban_case=ban_case, think=think)
