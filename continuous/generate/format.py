import datetime as dt

from outlines import types

from .. import engines
from ..engines.formats import DATE, TIME
from .base import SequenceGenerator, check_model, make

_FORMATS = {
    int: (types.integer.pattern, int),
    float: (types.number.pattern, float),
    bool: (types.boolean.pattern, lambda s: s == "True"),
    str: (types.string.pattern, lambda s: s[1:-1]),
    # outlines' date patterns allow 2023-02-31: ours only dates that exist.
    dt.datetime: (f"{DATE} {TIME}", dt.datetime.fromisoformat),
    dt.date: (DATE, dt.date.fromisoformat),
    dt.time: (TIME, dt.time.fromisoformat),
}


def format(model, python_type, sampler=None, *, engine=None, ban=None, ban_case=False) -> SequenceGenerator:
    """A value of a Python type written as text; ``value`` is that value.

    Parameters
    ----------
    python_type
        ``int``, ``float``, ``bool`` (``True``/``False``), ``str`` (a double-quoted
        string), ``datetime.date`` (``YYYY-MM-DD``), ``datetime.time`` (``HH:MM:SS``)
        or ``datetime.datetime`` (date and time separated by a space).
    engine
        The constraint engine: ``"llguidance"`` (the default) or ``"outlines_core"``.
    ban, ban_case
        Phrases and ``regex`` patterns the output may not contain (a dict phrase ->
        factor for soft bans), and whether phrases match case (:mod:`continuous.ban`).
    """
    if python_type not in _FORMATS:
        names = ", ".join(getattr(t, "__name__", str(t)) for t in _FORMATS)
        raise ValueError(f"format supports {names}; got {python_type!r}")
    check_model(model)
    pattern, parse = _FORMATS[python_type]
    constraint = engines.regex(pattern, model.tokenizer, engine=engine)
    return make(model, sampler, constraint, parse, kind="format", ban=ban, ban_case=ban_case)
