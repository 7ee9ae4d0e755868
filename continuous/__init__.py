"""continuous: structured generation whose results keep the model's KV cache.

``continuous(generate.json(model, Person))`` returns a function of prompts and
:class:`SequenceState` values: string-like states that carry their cache, so that a
conversation, a slice or a sum never recomputes what the model has already seen.
"""

import importlib

from .errors import (
    BanExhausted,
    BatchMismatch,
    BatchMismatchError,
    CacheResetWarning,
    ContextWarning,
    SampleMismatch,
    SampleMismatchError,
    SlicingError,
)

__version__ = "0.1.0"

__all__ = [
    "continuous", "ContinuousGenerator", "SequenceState", "generate", "models", "samplers", "chat", "hf",
    "SampleMismatch", "BatchMismatch", "SlicingError", "CacheResetWarning",
    "SampleMismatchError", "BatchMismatchError", "BanExhausted", "ContextWarning", "Think", "Reply", "ToolCall",
    "PromptLookup",
]

# Imported on first use: a swarm server (`python -m continuous.remote.server`) needs none of
# them, and outlines and transformers take seconds to import.
_LAZY = {
    "continuous": ".wrapper", "ContinuousGenerator": ".wrapper", "SequenceState": ".state",
    "generate": ".generate", "models": ".models", "samplers": ".samplers", "chat": ".chat", "hf": ".hf",
    "Think": ".think", "Reply": ".generate.tools", "ToolCall": ".generate.tools",
    "PromptLookup": ".decode.speculate",
}


def __getattr__(name):
    if name in _LAZY:
        module = importlib.import_module(_LAZY[name], __name__)
        value = module if name in ("generate", "models", "samplers", "chat", "hf") else getattr(module, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
