"""One step's choice of tokens, for the rows of one call or of many calls at once.

A decoding call does not choose its tokens itself: it yields a :class:`Draw` (its rows'
scores after its own processors) and is sent back a :class:`Drawn`. The model's engine
gathers the draws of every call that steps together and runs them as one
(:func:`Draw.run_all`): one mask for every row, one pass of the row-wise processors
(constraint, forced tokens, bans, finished rows), one sampler pass whose parameters
are per row, and one read to the host. A call running alone runs the same code with
one draw, so a row's tokens never depend on who shares its step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from types import MappingProxyType
from typing import Any, Callable, Mapping

import torch

from ..models.scheduler import Work
from ..samplers import Multinomial, RowDraws, Sampler, choose
from ..transfer import cat_rows, split_rows, to_host
from .constraints import RowConstraints
from .joined import Joined
from .processors import Processor, Scores, shared
from .rows import RowView

__all__ = ["Draw", "Drawn", "NOTHING_IMPOSED"]

#: No token imposed on any row (most draws: one object, never written).
NOTHING_IMPOSED: Mapping[int, tuple[int, float]] = MappingProxyType({})


@dataclass(eq=False, kw_only=True)
class Draw(Work):
    """A call's ask for its rows' next tokens.

    Attributes
    ----------
    logits
        ``[rows, vocab]`` the rows' scores after the call's own processors (the user's,
        bias and penalties).
    weights
        ``[rows]`` the rows' weights before the step.
    constraints
        The rows' constraints (their masks).
    views
        Each row's :class:`~continuous.decode.rows.RowView`.
    sampler
        The call's sampler.
    rng
        What it draws from (:class:`~continuous.samplers.RowDraws`, a generator, or ``None``).
    sentinel
        The token a finished row "emits" at no cost.
    after
        Processors that see the call's rows together with no other call's (beam ranking).
    imposed
        Row -> ``(token, log-probability)`` to take instead of the sampled one (tokens that a
        check of drafts decided).
    step
        The step's index in the call.
    queue
        ``queue(ids)``, called with the rows' sampled ids (``[rows, 1]``) on the device before the host reads
        them (the next step queued behind the read); what it returns is :attr:`Drawn.queued`.
    logprobs
        Whether the call records log-probabilities: what each row's weight gained is read to
        the host with the ids (:attr:`Drawn.gained_h`).
    family
        What the draws that run together share (:meth:`family_of`, the same at every step of a
        call: made once); ``None``: this draw runs alone.
    consume
        ``consume(ids, dead) -> rows``: moves the call's matchers past the tokens its rows take
        (host ids, and 1 where a row had no token), leaving their masks unwritten; returns the
        rows moved. The masks of every draw's moved rows are then written at once, in one fill
        (the call's step takes those rows on from there).
    seat
        The call's :class:`~continuous.decode.loop.Decoding`, at its first step, when its rows may be
        stepped with those of other calls that start with it (:meth:`tables`); else ``None``.
    """

    logits: torch.Tensor
    weights: torch.Tensor
    constraints: RowConstraints
    views: list[RowView]
    sampler: Sampler
    rng: Any
    sentinel: int
    after: list[Processor] = field(default_factory=list)
    imposed: Mapping[int, tuple[int, float]] = field(default_factory=lambda: NOTHING_IMPOSED)
    step: int = 0
    queue: Callable[[torch.Tensor], Any] | None = None
    logprobs: bool = False
    family: Any = None
    consume: Callable[[list[int], list[int]], list[int]] | None = None
    seat: Any = None

    @staticmethod
    def family_of(sampler: Sampler, after: list[Processor], logits: torch.Tensor):
        """The family of a call's draws: those of one family run together (the same device,
        vocabulary and kind of sampler); beams, which rank a call's rows together, and
        processors of the call's rows alone have none: they run alone."""
        if sampler.joint or after:
            return None
        return (logits.device, logits.shape[-1], type(sampler))

    @property
    def key(self):
        return id(self) if self.family is None else self.family

    @staticmethod
    def tables(draws: list["Draw"]) -> list[tuple[list[int], Callable]]:
        """The draws whose calls step as one from now on (:mod:`.joined`): per set of calls at their
        first step with the same :attr:`~continuous.decode.loop.Decoding.seat_key`, their indices and
        ``make(seats)``, the coroutine of the call that steps their rows."""
        sets: dict = {}
        for i, d in enumerate(draws):
            if d.seat is not None:
                sets.setdefault(d.seat.seat_key, []).append(i)
        return [(indices, partial(Joined.steps_of, [draws[i].seat for i in indices]))
                for indices in sets.values() if len(indices) > 1]

    @staticmethod
    def run_all(draws: list["Draw"]) -> list["Drawn"]:
        """Choose the next tokens of every draw's rows at once (draws of one :attr:`key`)."""
        counts = [len(d.views) for d in draws]
        logits = cat_rows([d.logits for d in draws])
        before = cat_rows([d.weights for d in draws])
        scores = Scores(logits, before, draws[0].step, [v for d in draws for v in d.views])
        for processor in shared([d.constraints for d in draws], draws[0].sentinel) + draws[0].after:
            processor(scores)
        rng = _draws(draws)
        ids, ancestors, weights = choose([d.sampler for d in draws], counts, scores.logits, scores.rank, rng)
        ids, weights = _impose(draws, counts, ids, weights, before)
        # The one transfer of the step: ids, which rows are left with no allowed token and
        # (beams) the rows they extend.
        joint = draws[0].sampler.joint
        no_token = scores.logits[ancestors, ids] == -torch.inf
        if not joint:  # a row with no token allowed keeps the weight it had
            weights = torch.where(no_token, before, weights)
        gained = weights - (before[ancestors] if joint else before)
        # ... and what each row's weight gained, for the calls that record log-probabilities.
        read = to_host(torch.stack([ids, no_token.long()] + ([ancestors] if joint else [])),
                       *([gained] if any(d.logprobs for d in draws) else []))
        # Each draw's rows of the ids (as the next forward takes them) and weights, as views made
        # together (the other tensors are taken apart only where read: most steps never read them).
        parts = list(zip(split_rows(ids[:, None], counts), split_rows(weights, counts)))
        # Queued behind the copy, the next steps run on the device while the host waits for it.
        queued = [d.queue(part[0]) if d.queue is not None else None for d, part in zip(draws, parts)]
        host, *gained_h = read()
        host_gained = gained_h[0] if gained_h else None
        out, at = [], 0
        for d, n, q, (ids_d, weights_d) in zip(draws, counts, queued, parts):
            span = slice(at, at + n)
            cost = None if d.constraints.constraint is None else scores.cost
            out.append(Drawn(ids=ids_d, ancestors=ancestors if joint else None, weights=weights_d, span=span,
                             step_gained=gained, step_logits=scores.logits, step_cost=cost, ids_h=host[0][span],
                             ancestors_h=host[2] if joint else None, dead=host[1][span], queued=q,
                             gained_h=host_gained[span] if d.logprobs else None))
            at += n
        _consume(draws, out)
        return out


@dataclass(kw_only=True, slots=True)
class Drawn:
    """A draw's outcome: per row, its token, the row it extends, its new weight (on the device and,
    for the tokens, rows and dead rows, on the host), and the scores it was drawn from.

    ``step_gained``, ``step_logits`` and ``step_cost`` are the step's tensors of every row
    drawn with this draw's; its rows of them are ``span`` (a call records the step's tensors
    with its rows, and reads its scores as :attr:`logits`).
    """

    ids: torch.Tensor  # [rows, 1]: as the next forward takes them
    ancestors: torch.Tensor | None  # None: each row extends itself (only beams reorder rows)
    weights: torch.Tensor
    span: slice
    step_gained: torch.Tensor  # what the step added to each row's weight (beams: to the row it extends)
    step_logits: torch.Tensor  # after every processor: what log-probabilities are read from
    step_cost: torch.Tensor | None  # nats the constraint's mask removed (None: free text)
    ids_h: list[int]
    ancestors_h: list[int] | None  # None: each row extends itself
    dead: list[int]  # 1 where the row had no allowed token
    queued: Any = None  # what the draw's ``queue`` returned
    gained_h: list[float] | None = None  # ``gained`` on the host, for a draw that asked for it
    error: Exception | None = None  # what consuming failed with: the call's own failure

    @property
    def logits(self) -> torch.Tensor:
        return self.step_logits[self.span]


def _consume(draws: list[Draw], out: list[Drawn]) -> None:
    """Move each draw's matchers past its rows' tokens, then write the masks of every moved row in
    one fill. A failure is its draw's own (on its :class:`Drawn`): the draws, which moved their
    matchers already, are never run again."""
    parts = []
    for d, drawn in zip(draws, out):
        if d.consume is None:
            continue
        try:
            parts.append((d.constraints, d.consume(drawn.ids_h, drawn.dead), drawn))
        except Exception as exc:  # noqa: BLE001 - raised by its call
            drawn.error = exc
    try:
        RowConstraints.refresh_all([(c, moved) for c, moved, _ in parts])
    except Exception:  # noqa: BLE001 - each part again, alone: one bad matcher fails only its call
        for c, moved, drawn in parts:
            try:
                RowConstraints.refresh_all([(c, moved)])
            except Exception as exc:  # noqa: BLE001 - raised by its call
                drawn.error = exc


def _draws(draws: list[Draw]):
    """What the sampler draws from: every row's own stream, or the one call's generator."""
    if len(draws) == 1 or not isinstance(draws[0].sampler, Multinomial):
        return draws[0].rng
    return RowDraws.joined([d.rng for d in draws])


def _impose(draws: list[Draw], counts: list[int], ids: torch.Tensor, weights: torch.Tensor, before: torch.Tensor):
    """The step's ids and weights with the tokens imposed on some rows."""
    if not any(d.imposed for d in draws):
        return ids, weights
    ids, weights = ids.clone(), weights.clone()
    at = 0
    for d, n in zip(draws, counts):
        for r, (token, logprob) in d.imposed.items():
            ids[at + r] = token
            weights[at + r] = before[at + r] + logprob
        at += n
    return ids, weights

