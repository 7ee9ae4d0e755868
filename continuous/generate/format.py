import datetime as dt

from outlines import types

from .. import engines
from ..engines.formats import DATE, TIME
from .base import SequenceGenerator, make
from .types import pattern_of

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
_OUTLINES = [(types.integer, int), (types.number, float), (types.boolean, bool), (types.string, str),
             (types.date, dt.date), (types.time, dt.time), (types.datetime, dt.datetime)]


def format(model, python_type, sampler=None, *, engine=None, ban=None, ban_case=False,
           think=None) -> SequenceGenerator:
    """A value of a Python type written as text; ``value`` is that value.

    Parameters
    ----------
    python_type
        ``int``, ``float``, ``bool`` (``True``/``False``), ``str`` (a double-quoted
        string), ``datetime.date`` (``YYYY-MM-DD``), ``datetime.time`` (``HH:MM:SS``)
        or ``datetime.datetime`` (date and time separated by a space); outlines' built-in
        terms of these types (``outlines.types.integer``...) are the same. Any other
        ``outlines.types`` term (``email``, ``Regex(...)``) gives its text.
    engine
        ``"llguidance"`` (the default) or ``"outlines_core"``.
    ban, ban_case, think
        As for every generator (:func:`~continuous.generate.text`).
    """
    # outlines' built-in terms of these types are the same formats; its other terms give text.
    python_type = next((t for term, t in _OUTLINES if python_type is term), python_type)
    if (pattern := pattern_of(python_type)) is not None:
        parse = str
    elif isinstance(python_type, type) and python_type in _FORMATS:
        pattern, parse = _FORMATS[python_type]
    else:
        names = ", ".join(getattr(t, "__name__", str(t)) for t in _FORMATS)
        raise ValueError(f"format supports {names} and outlines.types terms; got {python_type!r}")
    return make(model, sampler, lambda tokenizer: engines.regex(pattern, tokenizer, engine=engine), parse,
                kind="format", ban=ban, ban_case=ban_case, think=think)
