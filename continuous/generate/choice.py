import re
from enum import Enum

from .base import SequenceGenerator, make


def choice(model, choices, sampler=None) -> SequenceGenerator:
    """One of the given strings; ``value`` is the chosen string (or Enum member).

    Parameters
    ----------
    choices
        A list of strings, or an ``Enum`` class (its members' values are the choices).
    """
    if isinstance(choices, type) and issubclass(choices, Enum):
        members = {str(m.value): m for m in choices}
        parse = members.__getitem__
    else:
        if isinstance(choices, str) or not all(isinstance(c, str) for c in choices):
            raise TypeError("choices must be a list of strings or an Enum class")
        members = {c: c for c in choices}
        parse = str
    if not members:
        raise ValueError("choice needs at least one choice")
    pattern = "(" + "|".join(re.escape(c) for c in members) + ")"
    return make(model, sampler, pattern, parse, kind="choice")
