from .base import SequenceGenerator, make


def text(model, sampler=None, *, ban=None, ban_case=False, think=None) -> SequenceGenerator:
    """Free text, until EOS, ``max_tokens`` or a ``stop_at`` string.

    Parameters
    ----------
    model
        A model from ``continuous.models``.
    sampler
        A sampler from ``continuous.samplers`` (default: greedy).
    ban, ban_case
        Phrases and ``regex`` patterns the output may not contain (a dict phrase ->
        factor for soft bans), and whether phrases match case (:mod:`continuous.ban`).
    think
        A thinking section of free text before the constraint: ``True`` (the model's own
        markers), an int (a token budget) or a :class:`~continuous.Think` (:mod:`continuous.think`).
    """
    return make(model, sampler, ban=ban, ban_case=ban_case, think=think)
