from .base import SequenceGenerator, make


def regex(model, pattern: str, sampler=None) -> SequenceGenerator:
    """Text matching a regular expression; ``value`` is the matched string.

    Raises
    ------
    ValueError
        When the pattern is invalid or no sequence of tokens can match it.
    """
    if not isinstance(pattern, str):
        raise TypeError(f"pattern must be a str, got {type(pattern).__name__}")
    return make(model, sampler, pattern, kind="regex")
