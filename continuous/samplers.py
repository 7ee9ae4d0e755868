"""Samplers: (logits, weights, rng) -> (next ids, ancestors, weights).

As in outlines v0, every sampler returns the index of the row each new token extends
(its ancestor), so beam search reordering and sample forking share the decoding loop.
Logits arrive masked (disallowed tokens are ``-inf``); weights are the cumulative
log-probabilities of the sampled tokens under the distribution actually sampled from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["Sampler", "Greedy", "Multinomial", "BeamSearch", "RowDraws", "greedy", "multinomial", "beam_search",
           "check_seed"]


def _check_count(value, name: str) -> None:
    # bool is an int subclass, and a float or str would only fail inside torch later.
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def _check_real(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return float(value)


def check_seed(seed) -> int | None:
    """Check a ``seed`` argument: ``None`` or an int that ``torch.Generator.manual_seed`` takes.

    Parameters
    ----------
    seed
        The seed given to a call.

    Returns
    -------
    int or None
        The seed, unchanged.

    Raises
    ------
    TypeError
        When the seed is not an int (a bool, a float, a str).
    ValueError
        When it does not fit in 64 bits (torch takes ``-2**63 <= seed < 2**64``).
    """
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__} {seed!r}")
    if not -(2**63) <= seed < 2**64:
        raise ValueError(f"seed must fit in 64 bits (-2**63 <= seed < 2**64), got {seed}")
    return seed


class RowDraws:
    """Uniform draws for sampling, a stream per row, seeded from a call's generator.

    The decoding loop gives a sampler one of these as its ``rng``. A row draws only where
    it has a choice (not where its constraint forces the token), so the same seed gives
    the same samples whether forced tokens are forwarded one per step or several at once,
    and whatever the other rows do.

    Parameters
    ----------
    rows
        Number of rows.
    rng
        The call's CPU generator (``None``: torch's default one).
    """

    def __init__(self, rows: int, rng: torch.Generator | None):
        seeds = torch.randint(0, 2**62, (rows,), generator=rng).tolist()
        self.streams = [torch.Generator().manual_seed(s) for s in seeds]
        self.choosing = [True] * rows

    def uniform(self) -> torch.Tensor:
        """``[rows, 1]`` float64 draws, one from each choosing row's stream (0.5 elsewhere, unused)."""
        return torch.tensor([[float(torch.rand((), generator=g, dtype=torch.float64))] if c else [0.5]
                             for g, c in zip(self.streams, self.choosing)], dtype=torch.float64)

    def select(self, rows: list[int], index: torch.Tensor | None = None) -> "RowDraws":
        """Reorder (and duplicate) rows: a repeated row gets a copy of its stream."""
        seen, streams = set(), []
        for i in rows:
            if i in seen:
                copy = torch.Generator()
                copy.set_state(self.streams[i].get_state())
                streams.append(copy)
            else:
                streams.append(self.streams[i])
            seen.add(i)
        self.streams = streams
        self.choosing = [self.choosing[i] for i in rows]
        return self


class Sampler:
    """Base class. ``samples`` is the number of rows per prompt the sampler keeps.

    ``joint`` says that the sampler ranks the rows of a prompt together (beam search):
    rows forked from one prefix are then identical at the first step, and the loop
    ranks only the first of them so that they choose distinct tokens. Samplers work on
    the logits' device; ``rng`` is a CPU generator whose draws travel to the device, so
    a seed gives the same choices on every device.
    """

    samples: int = 1
    joint = False
    #: Whether it draws random numbers (the loop then gives it a :class:`RowDraws`).
    random = False

    def __call__(self, logits: torch.Tensor, weights: torch.Tensor, rng: "torch.Generator | RowDraws | None",
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def logprobs(self, logits: torch.Tensor) -> torch.Tensor:
        """The log-probabilities of the distribution the sampler draws from (what weights sum)."""
        return torch.log_softmax(logits, dim=-1)


@dataclass(frozen=True)
class Greedy(Sampler):
    """Always the most likely token."""

    samples: int = 1

    def __post_init__(self):
        _check_count(self.samples, "samples")

    def __call__(self, logits, weights, rng=None):
        logprobs = self.logprobs(logits)
        ids = logprobs.argmax(dim=-1)
        ancestors = torch.arange(logits.shape[0], device=logits.device)
        return ids, ancestors, weights + logprobs.gather(1, ids[:, None]).squeeze(1)


@dataclass(frozen=True)
class Multinomial(Sampler):
    """Sampling with temperature, top-k, top-p (nucleus) and min-p filtering."""

    samples: int = 1
    top_k: int | None = None
    top_p: float | None = None
    temperature: float = 1.0
    min_p: float | None = None
    random = True

    def __post_init__(self):
        _check_count(self.samples, "samples")
        if _check_real(self.temperature, "temperature") <= 0:
            raise ValueError(f"temperature must be > 0 (use samplers.greedy() for 0), got {self.temperature}")
        if self.top_k is not None:
            _check_count(self.top_k, "top_k")
        if self.top_p is not None and not 0 < _check_real(self.top_p, "top_p") <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.min_p is not None and not 0 <= _check_real(self.min_p, "min_p") <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits after temperature, top-k, top-p and min-p."""
        logits = logits / self.temperature
        if self.min_p:
            # A token stays when its probability is at least min_p times the likeliest one's.
            logprobs = torch.log_softmax(logits, dim=-1)
            floor = logprobs.max(dim=-1, keepdim=True).values + math.log(self.min_p)
            logits = logits.masked_fill(logprobs < floor, -torch.inf)
        if self.top_k is not None and self.top_k < logits.shape[-1]:
            kth = torch.topk(logits, self.top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, -torch.inf)
        if self.top_p is not None and self.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
            cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
            # Drop a token when the tokens before it already hold top_p of the mass.
            drop_sorted = (cum - torch.softmax(sorted_logits, dim=-1)) >= self.top_p
            drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
            logits = logits.masked_fill(drop, -torch.inf)
        return logits

    def logprobs(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.process(logits), dim=-1)

    def __call__(self, logits, weights, rng=None):
        logprobs = self.logprobs(logits)
        # Inverse-CDF sampling from uniform draws of a CPU generator: the same seed gives
        # the same tokens whatever the device, and nothing but the draws crosses to it.
        if isinstance(rng, RowDraws):
            u = rng.uniform().to(logits.device)
        else:
            u = torch.rand(logits.shape[0], 1, generator=rng, dtype=torch.float64).to(logits.device)
        cdf = logprobs.double().exp().cumsum(-1)
        # The first token whose CDF exceeds the draw: it has a positive probability. A row
        # with nothing allowed finds none; it gets the last id, which the loop sees is forbidden.
        ids = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1).clamp_(max=logits.shape[-1] - 1)
        ancestors = torch.arange(logits.shape[0], device=logits.device)
        return ids, ancestors, weights + logprobs.gather(1, ids[:, None]).squeeze(1)


@dataclass(frozen=True)
class BeamSearch(Sampler):
    """Beam search: each prompt keeps ``beams`` rows, the most likely continuations overall."""

    samples: int = 1
    joint = True

    def __post_init__(self):
        _check_count(self.samples, "beams")

    @property
    def beams(self) -> int:
        return self.samples

    def __call__(self, logits, weights, rng=None):
        rows, vocab = logits.shape
        k = self.samples
        batch = rows // k
        logprobs = self.logprobs(logits)
        scores = (weights[:, None] + logprobs).view(batch, k * vocab)
        top, flat = torch.topk(scores, k, dim=-1)
        ancestors = (flat // vocab + torch.arange(batch, device=logits.device)[:, None] * k).view(-1)
        return (flat % vocab).view(-1), ancestors, top.view(-1)


def greedy() -> Greedy:
    """Greedy decoding: the most likely token at each step (the default)."""
    return Greedy()


def multinomial(samples: int = 1, *, top_k: int | None = None, top_p: float | None = None,
                temperature: float = 1.0, min_p: float | None = None) -> Multinomial:
    """Sampling from the model's distribution.

    Parameters
    ----------
    samples
        Samples per prompt: a state of ``samples == 1`` given to this sampler forks.
    top_k
        Keep only the ``top_k`` most likely tokens.
    top_p
        Keep the smallest set of most likely tokens holding ``top_p`` of the mass.
    temperature
        Divides the logits before sampling.
    min_p
        Keep the tokens whose probability is at least ``min_p`` times the likeliest one's.
    """
    return Multinomial(samples, top_k, top_p, temperature, min_p)


def beam_search(beams: int = 1) -> BeamSearch:
    """Beam search keeping ``beams`` rows per prompt (beams count as samples)."""
    return BeamSearch(beams)
