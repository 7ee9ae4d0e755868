"""Samplers: (logits, weights, rng) -> (next ids, ancestors, weights).

As in outlines v0, every sampler returns the index of the row each new token extends
(its ancestor), so beam search reordering and sample forking share the decoding loop.
Logits arrive masked (disallowed tokens are ``-inf``); weights are the cumulative
log-probabilities of the sampled tokens under the distribution actually sampled from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["Sampler", "Greedy", "Multinomial", "BeamSearch", "RowDraws", "greedy", "multinomial", "beam_search",
           "check_seed", "choose", "filtered"]


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

    @classmethod
    def joined(cls, parts: list["RowDraws"]) -> "RowDraws":
        """The rows of several calls' draws, in order (each row keeps its own stream)."""
        joined = cls.__new__(cls)
        joined.streams = [g for p in parts for g in p.streams]
        joined.choosing = [c for p in parts for c in p.choosing]
        return joined

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

    @staticmethod
    def per_row(samplers: list["Sampler"], counts: list[int]) -> "Sampler":
        """One sampler for the rows of several calls (samplers of one class), ``counts[i]`` rows
        drawn as ``samplers[i]`` draws them."""
        return samplers[0]


@dataclass(frozen=True)
class Greedy(Sampler):
    """Always the most likely token."""

    samples: int = 1

    def __post_init__(self):
        _check_count(self.samples, "samples")

    def __call__(self, logits, weights, rng=None):
        logprobs = self.logprobs(logits)
        if _on_host(logprobs):
            # The first likeliest token, as torch's ``max`` finds it, in a tenth of its time on a CPU
            # (0.12 against 1.5 ms for 16 rows of a 49,152-token vocabulary).
            ids = torch.from_numpy(np.argmax(logprobs.numpy(), axis=-1))
            best = logprobs.gather(1, ids[:, None]).squeeze(1)
        else:
            best, ids = logprobs.max(dim=-1)
        ancestors = torch.arange(logits.shape[0], device=logits.device)
        return ids, ancestors, weights + best


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
        return filtered(logits, self.temperature, self.top_k, self.top_p, self.min_p)

    def logprobs(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.process(logits), dim=-1)

    def __call__(self, logits, weights, rng=None):
        return _sample(self.logprobs(logits), weights, rng)

    @staticmethod
    def per_row(samplers: list["Multinomial"], counts: list[int]) -> "Sampler":
        """Their parameters as per-row columns (one sampler when they are all the same)."""
        if all(s == samplers[0] for s in samplers):
            return samplers[0]
        return _PerRow.of(samplers, counts)


def filtered(logits: torch.Tensor, temperature, top_k, top_p, min_p) -> torch.Tensor:
    """``logits`` after temperature, min-p, top-k and top-p. Each parameter is one number for
    every row, or a ``[rows, 1]`` tensor of per-row values (then ``min_p`` holds ``log(min_p)``,
    and a row without a filter holds a value that keeps every token); ``None``: not applied.
    A row's result is the same either way."""
    if torch.is_tensor(temperature) or temperature != 1:
        logits = logits / temperature
    if min_p is not None and (torch.is_tensor(min_p) or min_p):
        # A token stays when its probability is at least min_p times the likeliest one's.
        logprobs = torch.log_softmax(logits, dim=-1)
        log_min = min_p if torch.is_tensor(min_p) else math.log(min_p)
        logits = _forbid(logits, logprobs < logprobs.amax(dim=-1, keepdim=True) + log_min)
    if top_k is not None and (torch.is_tensor(top_k) or top_k < logits.shape[-1]):
        if torch.is_tensor(top_k):
            kth = _descending(logits)[0].gather(1, top_k.clamp(max=logits.shape[-1]) - 1)
        else:
            kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = _forbid(logits, logits < kth)
    if top_p is not None and (torch.is_tensor(top_p) or top_p < 1.0):
        logits = _forbid(logits, _past_top_p(logits, top_p))
    return logits


#: How many of each row's likeliest tokens top-p looks at first, on a CPU (then every token):
#: a trained model's likeliest few hundred usually hold the mass top-p keeps.
_HEADS = (256, 4096)


def _past_top_p(logits: torch.Tensor, top_p) -> torch.Tensor:
    """Where top-p drops a token: the tokens before it, from the likeliest, already hold
    ``top_p`` of the mass. On a CPU only the likeliest few are sorted, as long as they hold it
    for every row (a sort of every token: 68 ms for 16 rows of 49,152 tokens; of the likeliest
    256 after numpy's partition, 3)."""
    lse = logits.amax(-1, keepdim=True) - torch.log_softmax(logits, -1).amax(-1, keepdim=True)
    vocab = logits.shape[-1]
    on_cpu = _on_host(logits)
    # Rows of other calls may have no top-p (a per-row value past 1): they drop nothing.
    limited = top_p < 1 if torch.is_tensor(top_p) else torch.ones((1, 1), dtype=torch.bool, device=logits.device)
    for k in [k for k in _HEADS if on_cpu and k < vocab] + [vocab]:
        head, order = _descending(logits, k)
        probs = (head - lse).exp()
        cum = probs.cumsum(-1)
        if k == vocab or bool(((cum[:, -1:] >= top_p) | ~limited).all()):  # what each row keeps is in the head
            break
    drop = limited.expand(logits.shape).clone()  # past the head: dropped where top-p applies
    return drop.scatter_(-1, order, (cum - probs) >= top_p)


def _descending(logits: torch.Tensor, k: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's ``k`` largest logits (``None``: all), from the largest, and where they are
    (``torch.sort``'s, descending). On a CPU, numpy partitions and sorts (every token of 16 rows
    of 49,152: 14 against 68 ms); tied logits may come in another order than torch's, as they may
    on another device."""
    if not _on_host(logits):
        values, order = torch.sort(logits, descending=True, dim=-1)
        return (values, order) if k is None else (values[:, :k], order[:, :k])
    negated = -logits.numpy()
    if k is None or k >= negated.shape[-1]:
        order = np.argsort(negated, axis=-1)
    else:
        part = np.argpartition(negated, k - 1, axis=-1)[:, :k]
        order = np.take_along_axis(part, np.argsort(np.take_along_axis(negated, part, -1), axis=-1), -1)
    order = torch.from_numpy(order)
    return logits.gather(-1, order), order


def _on_host(t: torch.Tensor) -> bool:
    """Whether ``t`` takes the samplers' numpy paths: a CPU tensor numpy reads as it is (float32
    or float64). Every other tensor keeps torch's ops, which are the fast ones on a device."""
    return t.device.type == "cpu" and t.dtype in (torch.float32, torch.float64)


def _forbid(logits: torch.Tensor, drop: torch.Tensor) -> torch.Tensor:
    """``logits.masked_fill(drop, -inf)``. On a CPU, ``logits`` plus a bias made from ``drop``'s bytes:
    ``masked_fill`` with a boolean mask is slow there (5 against 1 ms for 16 rows of 49,152 tokens)."""
    if not _on_host(logits):
        return logits.masked_fill(drop, -torch.inf)
    # 1 * -inf is -inf and 0 * -inf is NaN, which becomes the 0 of a token kept.
    bias = drop.view(torch.uint8).to(logits.dtype).mul_(-torch.inf).nan_to_num_(nan=0.0, neginf=-torch.inf)
    return logits + bias


@dataclass(frozen=True, eq=False)
class _PerRow(Sampler):
    """Multinomial sampling whose parameters are per-row ``[rows, 1]`` columns (see :func:`filtered`)."""

    temperature: torch.Tensor
    top_k: torch.Tensor | None
    top_p: torch.Tensor | None
    min_p: torch.Tensor | None
    random = True

    @classmethod
    def of(cls, samplers: list["Multinomial"], counts: list[int]) -> "_PerRow":
        def column(values: list, neutral, dtype):
            if all(v is None for v in values):
                return None
            values = [neutral if v is None else v for v in values]
            return torch.tensor(values, dtype=dtype).repeat_interleave(torch.tensor(counts))[:, None]

        return cls(column([float(s.temperature) for s in samplers], 1.0, torch.float32),
                   column([s.top_k for s in samplers], 2**62, torch.long),
                   # 2: a mass never reached (nothing dropped), as a top_p of 1 drops nothing
            column([s.top_p if s.top_p is None or s.top_p < 1 else 2.0 for s in samplers], 2.0, torch.float32),
                   column([None if s.min_p is None else math.log(s.min_p) if s.min_p else -math.inf
                           for s in samplers], -math.inf, torch.float32))

    def logprobs(self, logits: torch.Tensor) -> torch.Tensor:
        on = lambda t: None if t is None else t.to(logits.device)  # noqa: E731
        return torch.log_softmax(filtered(logits, on(self.temperature), on(self.top_k), on(self.top_p),
                                          on(self.min_p)), dim=-1)

    def __call__(self, logits, weights, rng=None):
        return _sample(self.logprobs(logits), weights, rng)


_FLOOR = math.exp(-700.0)


def _sample(logprobs: torch.Tensor, weights: torch.Tensor, rng) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse-CDF sampling from uniform draws of a CPU generator: the same seed gives the
    same tokens whatever the device, and nothing but the draws crosses to it."""
    if isinstance(rng, RowDraws):
        u = rng.uniform().to(logprobs.device)
    else:
        u = torch.rand(logprobs.shape[0], 1, generator=rng, dtype=torch.float64).to(logprobs.device)
    # exp(-inf) (a forbidden token) is slow on some CPUs (11 against 3 ms for 16 rows of 49,152 tokens,
    # most forbidden): the floor e^-700, a normal double, is taken and given back, leaving every
    # probability above 1e-288 exactly as it was and a forbidden token's exactly 0.
    cdf = logprobs.double().clamp_(min=-700.0).exp_().sub_(_FLOOR).cumsum_(-1)
    # The first token whose CDF exceeds the draw: it has a positive probability. A row
    # with nothing allowed finds none; it gets the last id, which the loop sees is forbidden.
    ids = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1).clamp_(max=logprobs.shape[-1] - 1)
    ancestors = torch.arange(logprobs.shape[0], device=logprobs.device)
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


def choose(samplers: list[Sampler], counts: list[int], logits: torch.Tensor, weights: torch.Tensor, rng
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One sampler pass over the rows of several calls: ``counts[i]`` rows, drawn as
    ``samplers[i]`` (samplers of one class) draws them. Returns ids, ancestors and weights."""
    sampler = samplers[0] if len(samplers) == 1 else type(samplers[0]).per_row(samplers, counts)
    return sampler(logits, weights, rng)


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
