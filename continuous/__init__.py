"""continuous: structured generation whose results keep the model's KV cache.

``continuous(generate.json(model, Person))`` returns a function of prompts and
:class:`SequenceState` values: string-like states that carry their cache, so that a
conversation, a slice or a sum never recomputes what the model has already seen.
"""

from . import generate, models, samplers
from .errors import (
    BatchMismatch,
    BatchMismatchError,
    CacheResetWarning,
    SampleMismatch,
    SampleMismatchError,
    SlicingError,
)
from .state import SequenceState
from .wrapper import ContinuousGenerator, continuous

__version__ = "0.1.0"

__all__ = [
    "continuous", "ContinuousGenerator", "SequenceState", "generate", "models", "samplers",
    "SampleMismatch", "BatchMismatch", "SlicingError", "CacheResetWarning",
    "SampleMismatchError", "BatchMismatchError",
]
