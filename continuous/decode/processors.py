"""Logits processors: what shapes each step's scores before the sampler chooses.

A processor takes the step's :class:`Scores` and changes its ``logits`` (the next
token's scores per row) or its ``rank`` (the weights the sampler ranks rows with). The
loop runs them in order: the user's processors, bias and penalties (on the call's own
rows), then on the rows of every call stepping together the constraint, forced tokens,
the bans and finished rows, then beam ranking (on a call's own rows).
Everything stays on the logits' device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

from ..transfer import to_device
from .constraints import RowConstraints
from .rows import RowView

__all__ = ["Scores", "Processor", "External", "Biased", "Penalized", "Constrained", "Forced", "Banned", "Finished",
           "ForkRanking", "run", "own", "shared"]


@dataclass
class Scores:
    """One step's scores, as the processors shape them.

    Attributes
    ----------
    logits
        ``[rows, vocab]`` scores of the next token; ``-inf`` forbids a token.
    rank
        ``[rows]`` weights the sampler ranks rows with (beam search).
    step
        The step's index in the call (0 first).
    views
        Each row's :class:`~continuous.decode.rows.RowView` at this step.
    cost
        ``[rows]`` the nats the constraint's mask removed at this step (``None``: free text).
    """

    logits: torch.Tensor
    rank: torch.Tensor
    step: int
    views: list[RowView]
    cost: torch.Tensor | None = None


class Processor(Protocol):
    def __call__(self, scores: Scores) -> None:
        """Change ``scores.logits`` or ``scores.rank`` (replace the tensors; never write in place)."""


class External:
    """transformers ``LogitsProcessor`` objects, run unchanged on the model's scores.

    They see what they see inside ``model.generate``: ``input_ids`` ``[rows, length]``
    (each row's tokens, left-padded with ``pad`` to the longest) and the scores.
    """

    def __init__(self, processors, pad: int):
        self.processors, self.pad = list(processors), pad

    def __call__(self, scores: Scores) -> None:
        ids = [[*row.context, *row.tokens] for row in scores.views]
        width = max(map(len, ids))
        input_ids = torch.tensor([[self.pad] * (width - len(i)) + i for i in ids], device=scores.logits.device)
        logits = scores.logits.clone()  # some processors write in place; the loop's logits stay as they were
        for processor in self.processors:
            logits = processor(input_ids, logits)
        scores.logits = logits


class Biased:
    """Add a fixed bias to some tokens' scores in every row (OpenAI's ``logit_bias``).

    Parameters
    ----------
    bias
        Token id -> what is added to its score.
    """

    def __init__(self, bias: dict[int, float]):
        self.bias = dict(bias)
        self._shift: torch.Tensor | None = None  # [vocab], built on the logits' device once

    def __call__(self, scores: Scores) -> None:
        logits = scores.logits
        shift = self._shift
        if shift is None or shift.device != logits.device or shift.shape[0] != logits.shape[-1]:
            shift = torch.zeros(logits.shape[-1], device=logits.device)
            ids = torch.tensor(list(self.bias), device=logits.device)
            shift[ids] = torch.tensor(list(self.bias.values()), device=logits.device)
            self._shift = shift
        scores.logits = logits + shift.to(logits.dtype)


class Penalized:
    """OpenAI's presence and frequency penalties: a token a row generated ``c`` times in this
    call loses ``frequency * c + presence * (c > 0)`` from its score in that row.

    The counts are made for every row at once, from the rows' generated tokens.
    """

    def __init__(self, presence: float, frequency: float):
        self.presence, self.frequency = float(presence), float(frequency)

    def __call__(self, scores: Scores) -> None:
        lengths = [len(row.tokens) for row in scores.views]
        if not any(lengths):
            return
        logits = scores.logits
        device = logits.device
        ids = torch.tensor([t for row in scores.views for t in row.tokens], device=device)
        which = torch.repeat_interleave(torch.arange(len(lengths), device=device),
                                        torch.tensor(lengths, device=device))
        counts = torch.zeros(logits.shape, device=device).index_put_((which, ids), torch.ones(len(ids), device=device),
                                                                     accumulate=True)
        penalty = self.frequency * counts + self.presence * (counts > 0)
        scores.logits = logits - penalty.to(logits.dtype)


class Constrained:
    """Forbid what each row's constraint does not allow next, and measure what that removed:
    ``-log`` of the probability mass the constraint allowed (0 for a finished row).

    The rows may be those of several calls of one model (``parts``, in order): their
    packed masks are unpacked together, once.
    """

    def __init__(self, *parts: RowConstraints):
        self.parts = parts

    def __call__(self, scores: Scores) -> None:
        bias = self._bias()
        if bias is None:
            return
        masked = scores.logits + bias.to(scores.logits.dtype)  # -inf where not allowed
        if any(c.constraint is not None for c in self.parts):
            total, kept = _logsumexp(scores.logits.float()), _logsumexp(masked.float())
            # A row with nothing allowed takes no token: it removed nothing it went on with.
            cost = torch.where(torch.isfinite(kept), total - kept, 0.0)
            finished = [row.finished for row in scores.views]
            if any(finished):
                cost = cost.masked_fill(to_device(finished, cost.device, torch.bool), 0.0)
            scores.cost = cost
        scores.logits = masked

    def _bias(self) -> torch.Tensor | None:
        first = self.parts[0]
        if len(self.parts) == 1 or all(c.matchers is None for c in self.parts):
            return first.bias()  # free text: the same for every call of a model
        # A call of free text among constrained ones: all its tokens allowed (-1: every bit set).
        packed = [c.bitmask if c.matchers is not None else torch.full_like(c.bitmask, -1) for c in self.parts]
        return first.bias_of(torch.cat(packed))


def _logsumexp(x: torch.Tensor) -> torch.Tensor:
    """``torch.logsumexp(x, -1)`` from the fused softmax kernel: ``logsumexp`` is about ten
    kernels on a GPU, and slow on a CPU where ``x`` holds ``-inf``. A row of only ``-inf``
    gives NaN."""
    return x.amax(-1) - torch.log_softmax(x, -1).amax(-1)


class Forced:
    """A row whose constraint forces its next token takes it, at no cost (without fast-forward,
    forced tokens come one per step: they are the same tokens, and carry no weight)."""

    def __call__(self, scores: Scores) -> None:
        forced = [(r, row.forced) for r, row in enumerate(scores.views) if row.forced is not None]
        if not forced:
            return
        logits = scores.logits.clone()
        rows, tokens = to_device(list(zip(*forced)), logits.device, torch.long)
        logits[rows] = -torch.inf
        logits[rows, tokens] = 0.0
        scores.logits = logits


class Banned:
    """Forbid (or down-weight) the tokens banned at each row's current position (rewinds record them)."""

    def __call__(self, scores: Scores) -> None:
        rows, tokens, shifts = [], [], []
        for r, row in enumerate(scores.views):
            for t, factor in row.banned.items():
                rows.append(r)
                tokens.append(t)
                shifts.append(-math.inf if factor == 0 else math.log(factor))
        if not rows:
            return
        logits = scores.logits
        at = tuple(to_device([rows, tokens], logits.device, torch.long))
        logits = logits.clone()
        logits[at] = logits[at] + to_device(shifts, logits.device, logits.dtype)
        scores.logits = logits


class Finished:
    """A finished row may only "emit" ``sentinel`` at no cost: its weight stays, and beam
    search can keep it among the best rows."""

    def __init__(self, sentinel: int):
        self.sentinel = sentinel

    def __call__(self, scores: Scores) -> None:
        finished = [row.finished for row in scores.views]
        if not any(finished):
            return
        logits = scores.logits
        done = to_device(finished, logits.device, torch.bool)[:, None]
        only = torch.full_like(logits[:1], -torch.inf)
        only[:, self.sentinel] = 0.0
        scores.logits = torch.where(done, only, logits)


class ForkRanking:
    """Rows forked from one prefix are identical at the first step: a joint sampler (beam
    search) ranks only the first of each group, so that they choose distinct tokens."""

    def __init__(self, fork: int):
        self.fork = fork

    def __call__(self, scores: Scores) -> None:
        if scores.step == 0:
            rank = scores.rank.clone().view(-1, self.fork)
            rank[:, 1:] = -torch.inf
            scores.rank = rank.view(-1)


def own(options, pad: int) -> list[Processor]:
    """The processors of a call's own rows, run before its rows join other calls' for the
    rest of the step: the user's, then the bias and penalties."""
    processors = list(options.penalties)
    if options.processors:
        processors.insert(0, External(options.processors, pad))
    return processors


def shared(parts: list[RowConstraints], sentinel: int) -> list[Processor]:
    """The processors that run on the rows of every call of a step at once, in order: the
    constraint, forced tokens, bans, finished rows (which "emit" ``sentinel`` at no cost)."""
    return [Constrained(*parts), Forced(), Banned(), Finished(sentinel)]


def run(processors: list[Processor], logits: torch.Tensor, rank: torch.Tensor, step: int, views: list[RowView]
        ) -> Scores:
    """Apply every processor in order to one step's scores."""
    scores = Scores(logits, rank, step, views)
    for processor in processors:
        processor(scores)
    return scores
