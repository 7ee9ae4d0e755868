import datetime as dt

from outlines import types

from .base import SequenceGenerator, make
from .json import DATE, TIME

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
        factor for soft bans), and whether phrases match case (SPEC section 6).
    """
    if python_type not in _FORMATS:
        names = ", ".join(getattr(t, "__name__", str(t)) for t in _FORMATS)
        raise ValueError(f"format supports {names}; got {python_type!r}")
    pattern, parse = _FORMATS[python_type]
    return make(model, sampler, pattern, parse, kind="format", engine=engine, ban=ban, ban_case=ban_case)
