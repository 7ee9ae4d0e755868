from .base import SequenceGenerator, make


def text(model, sampler=None) -> SequenceGenerator:
    """Free text, until EOS, ``max_tokens`` or a ``stop_at`` string.

    Parameters
    ----------
    model
        A model from ``continuous.models``.
    sampler
        A sampler from ``continuous.samplers`` (default: greedy).
    """
    return make(model, sampler)
