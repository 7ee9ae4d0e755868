"""Why a row stopped."""

from __future__ import annotations

from enum import Enum

__all__ = ["Finish"]


class Finish(str, Enum):
    """Why a call stopped a row (a ``str``: ``Finish.EOS == "eos"``)."""

    #: An end id was sampled, or the constraint is complete (nothing but an end may follow).
    EOS = "eos"
    #: A ``stop_at`` string was generated.
    STOP = "stop"
    #: ``max_tokens`` were generated.
    LENGTH = "length"
    #: The model's context ran out.
    CONTEXT = "context"
    #: Every way on was banned (a banned phrase, or a value its schema forbids).
    BAN_EXHAUSTED = "ban_exhausted"

    def __str__(self) -> str:
        return self.value
