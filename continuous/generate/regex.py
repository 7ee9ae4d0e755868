import re

from .. import engines
from .base import SequenceGenerator, make
from .types import pattern_of

_C = re._constants
_WHOLE_TEXT = (_C.AT_BEGINNING, _C.AT_END, _C.AT_BEGINNING_STRING, _C.AT_END_STRING)


def _anchors(items) -> bool:
    """Whether a parsed pattern holds ``^``, ``$``, ``\\A`` or ``\\Z`` anywhere."""
    for op, arg in items:
        if op == re._constants.AT and arg in _WHOLE_TEXT:
            return True
        for sub in arg if isinstance(arg, (list, tuple)) else [arg]:
            if isinstance(sub, re._parser.SubPattern) and _anchors(sub):
                return True
            if isinstance(sub, (list, tuple)) and any(
                    isinstance(x, re._parser.SubPattern) and _anchors(x) for x in sub):
                return True
    return False


def regex(model, pattern: str, sampler=None, *, engine=None, ban=None, ban_case=False,
          think=None) -> SequenceGenerator:
    """Text matching a regular expression; ``value`` is the matched string.

    Parameters
    ----------
    pattern
        The regular expression (Rust ``regex`` syntax, as both engines read it), or an
        ``outlines.types`` term (``Regex``, ``integer``, ``either(...)``...).
    engine
        ``"llguidance"`` (the default) or ``"outlines_core"``.
    ban, ban_case, think
        As for every generator (:func:`~continuous.generate.text`).

    Raises
    ------
    ValueError
        When the pattern is invalid, has anchors (``^``, ``$``: the whole generated
        text is matched already) or no sequence of tokens can match it.
    """
    pattern = pattern_of(pattern) or pattern
    if not isinstance(pattern, str):
        raise TypeError(f"pattern must be a str or an outlines.types term (Regex, integer, ...), "
                        f"got {type(pattern).__name__}")
    try:
        anchored = _anchors(re._parser.parse(pattern))
    except re.error:
        anchored = False  # outlines_core judges the syntax when the index is built
    if anchored:
        raise ValueError(f"the pattern {pattern!r} has anchors (^, $, \\A, \\Z): the constraint already "
                         "matches the whole generated text, remove them")
    return make(model, sampler, lambda tokenizer: engines.regex(pattern, tokenizer, engine=engine), kind="regex",
                ban=ban, ban_case=ban_case, think=think)
