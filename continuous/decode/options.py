"""What one call asks of the decoding loop, checked once when the call is made."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import SampleMismatch
from ..samplers import Greedy, Multinomial, Sampler, check_seed
from .processors import Biased, Penalized
from .speculate import as_drafter, check_speculation

__all__ = ["Options", "check_rewinds"]


def check_rewinds(sampler: Sampler, ban, constraint) -> None:
    """Refuse beam search with what makes rows rewind: ``ban=``, or a constraint whose watch
    enforces what its grammar could not (a relaxed JSON schema's ``uniqueItems``...).

    A rewind takes one row back; beams rank every row of a prompt together at each step,
    so the ranking the rewind undoes would have to be made again.
    """
    if not (sampler.joint and sampler.samples > 1):
        return
    watched = constraint is not None and constraint.watch() is not None
    if ban is not None or watched:
        what = "ban=" if ban is not None else f"a schema's {', '.join(sorted(constraint.dropped))}"
        raise ValueError(f"beam search cannot serve {what}: rows rewind on what they must not keep, and a rewind "
                         "would have to re-rank every beam; use greedy or multinomial sampling")


@dataclass(frozen=True, kw_only=True)
class Options:
    """What a call asks of the loop. Build it with :meth:`from_call`.

    Attributes
    ----------
    sampler
        How the call chooses tokens.
    max_tokens
        Most tokens generated per row (``None``: until EOS or the context).
    stop_at
        Strings that end a row once generated (kept in the text, not in the value).
    rng
        ``torch.Generator`` of the sampler.
    fast_forward
        Forward the tokens a constraint forces together with the sampled one, in one call.
    bans
        A :class:`~continuous.ban.BanList`: a row whose text makes a banned match rewinds
        to the token where it starts, forbids (or down-weights) that token there and goes on.
    heal
        Back each row up over its last tokens that a longer token could extend, and make
        the first generated tokens spell them again (:mod:`continuous.heal`).
    fork
        Each row becomes ``fork`` rows after the top-up (samples share the prefix's cache).
    processors
        transformers ``LogitsProcessor`` objects (``(input_ids, scores) -> scores``), run on
        the model's scores before the constraint.
    penalties
        The call's :class:`~continuous.decode.processors.Biased` and
        :class:`~continuous.decode.processors.Penalized` (``logit_bias``, ``presence_penalty``,
        ``frequency_penalty``), run after ``processors``.
    logprobs
        Record each generated token's log-probability and this many likeliest alternatives
        (``None``: record nothing).
    speculate
        A drafter (:class:`~continuous.decode.speculate.PromptLookup` or
        :class:`~continuous.decode.speculate.DraftModel`, ``None``: none): each step forwards
        each row's draft after its tokens and keeps what the model would have chosen.
    """

    sampler: Sampler = Greedy()
    max_tokens: int | None = None
    stop_at: tuple[str, ...] = ()
    rng: torch.Generator | None = None
    fast_forward: bool = True
    bans: Any = None
    heal: bool = False
    fork: int = 1
    processors: tuple = ()
    penalties: tuple = ()
    logprobs: int | None = None
    speculate: Any = None

    @classmethod
    def from_call(cls, generator, samples_in: int = 1, fast_forward: bool = True, *, max_tokens=None, stop_at=None,
                  seed=None, rng=None, heal=False, sampler=None, temperature=None, top_p=None, top_k=None,
                  min_p=None, repetition_penalty=None, logits_processors=None, logprobs=None,
                  speculate=None, logit_bias=None, presence_penalty=None, frequency_penalty=None) -> "Options":
        """Check a call's arguments (the generator's ``__call__`` documents them) and build its options.

        Parameters
        ----------
        generator
            The :class:`~continuous.generate.base.SequenceGenerator` called.
        samples_in
            Rows per prompt of the input (1 for prompts: rows fork to the sampler's samples).
        fast_forward
            Whether forced tokens are forwarded with the sampled one.

        Raises
        ------
        TypeError, ValueError
            For an argument of the wrong type or value, or a combination the loop cannot serve.
        """
        chosen = _sampler(generator, sampler, dict(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p))
        if samples_in not in (1, chosen.samples):
            raise SampleMismatch(f"the state has {samples_in} samples per prompt and the sampler makes "
                                 f"{chosen.samples}")
        check_rewinds(chosen, generator.ban, generator.constraint)
        if generator.scorer is not None and heal:
            raise ValueError("choice scores are of the options after the prompt as it is: call without heal=")
        processors = _processors(repetition_penalty, logits_processors)
        penalties = _penalties(logit_bias, presence_penalty, frequency_penalty, len(generator.model.tokenizer))
        drafter = as_drafter(speculate, generator.model)
        check_speculation(drafter, chosen, processors + penalties)
        return cls(sampler=chosen, max_tokens=_check_count(max_tokens, "max_tokens"), stop_at=_check_stop_at(stop_at),
                   rng=_check_rng(seed, rng), fast_forward=fast_forward, bans=generator.ban, heal=bool(heal),
                   fork=chosen.samples if samples_in == 1 else 1, processors=processors, penalties=penalties,
                   logprobs=_check_count(logprobs, "logprobs"), speculate=drafter)


def _sampler(generator, sampler, shorthand: dict) -> Sampler:
    """The call's sampler: ``sampler``, the shorthand's multinomial, or the generator's."""
    shorthand = {k: v for k, v in shorthand.items() if v is not None}
    if sampler is not None:
        if shorthand:
            raise ValueError(f"give sampler= or {', '.join(shorthand)}, not both")
        if not isinstance(sampler, Sampler):
            raise TypeError(f"sampler must come from continuous.samplers, got {type(sampler).__name__}")
        return sampler
    if not shorthand:
        return generator.sampler
    samples = generator.sampler.samples
    if shorthand == {"temperature": 0}:
        return Greedy(samples)
    return Multinomial(samples, **shorthand)


def _check_count(value, name: str):
    """A non-negative int, or ``None``."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"{name} must be a non-negative int or None, got {value!r}")
    return value


def _check_stop_at(stop_at) -> tuple[str, ...]:
    if stop_at is None:
        return ()
    if isinstance(stop_at, str):
        return (stop_at,)
    if isinstance(stop_at, (list, tuple)) and all(isinstance(s, str) for s in stop_at):
        return tuple(stop_at)
    raise TypeError("stop_at must be a str or a list of str")


def _check_rng(seed, rng):
    if seed is not None and rng is not None:
        raise ValueError("give seed or rng, not both")
    if check_seed(seed) is not None:
        return torch.Generator().manual_seed(seed)
    if rng is not None and not isinstance(rng, torch.Generator):
        raise TypeError(f"rng must be a torch.Generator, got {type(rng).__name__}")
    return rng


def _penalties(logit_bias, presence_penalty, frequency_penalty, vocab: int) -> tuple:
    """The bias and penalty processors of a call (none for absent or zero values)."""
    out = []
    if logit_bias:
        if not isinstance(logit_bias, dict):
            raise TypeError(f"logit_bias must be a dict of token id -> bias, got {type(logit_bias).__name__}")
        for token, bias in logit_bias.items():
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab:
                raise ValueError(f"logit_bias: {token!r} is not a token id of this tokenizer (0 to {vocab - 1})")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or math.isnan(bias):
                raise ValueError(f"logit_bias: the bias of token {token} must be a number, got {bias!r}")
        out.append(Biased(logit_bias))
    for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value)):
            raise ValueError(f"{name} must be a finite number, got {value!r}")
    if presence_penalty or frequency_penalty:
        out.append(Penalized(presence_penalty or 0.0, frequency_penalty or 0.0))
    return tuple(out)


def _processors(repetition_penalty, logits_processors) -> tuple:
    processors = list(logits_processors or ())
    if not all(callable(p) for p in processors):
        raise TypeError("logits_processors must be callables (input_ids, scores) -> scores, such as "
                        "transformers LogitsProcessor objects")
    if repetition_penalty is not None:
        from transformers import RepetitionPenaltyLogitsProcessor

        processors.insert(0, RepetitionPenaltyLogitsProcessor(float(repetition_penalty)))
    return tuple(processors)
