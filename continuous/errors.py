"""Exceptions and warnings of the library."""

__all__ = [
    "SampleMismatch", "BatchMismatch", "SlicingError", "CacheResetWarning",
    "SampleMismatchError", "BatchMismatchError", "BanExhausted", "ContextWarning",
]


class SampleMismatch(ValueError):
    """Two operands, or a state and a generator, disagree on the number of samples."""


class BatchMismatch(ValueError):
    """Two operands disagree on the batch size (or a list has the wrong length)."""


class SlicingError(Exception):
    """A slice cannot keep the KV cache; the state falls back to recomputing."""


class CacheResetWarning(UserWarning):
    """An operation changed token positions, so the KV cache was dropped."""


class BanExhausted(UserWarning):
    """A row could not avoid a banned phrase: it ends with its longest clean prefix."""


class ContextWarning(UserWarning):
    """The model's context ended a generation before its other limits (``finish_reasons``: ``context``)."""


SampleMismatchError = SampleMismatch
BatchMismatchError = BatchMismatch
