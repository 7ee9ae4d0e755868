"""Concurrent calls on one model share its forward passes (continuous batching).

A model owns one :class:`Scheduler`. Every decoding call *joins* it for its lifetime and
gets a :class:`Turn`; the call runs on its own thread (the caller's, or a worker's for
``acall``/``astream``) and calls the model's ``forward`` as it would alone. The
scheduler makes those calls meet: a forward waits until every call that is computing
its step has asked for its own, then one thread (the *leader*) runs them as one batched
forward and hands each call its logits and cache. So rows join the batch at the step
after their prefill and leave when their call ends; a short call never waits for a long
one, and a call whose consumer is slow (a stream nobody reads) is *parked*: nobody waits
for it.

The queue is the scheduler's ``waiting`` list, under its lock; a round takes:

- the requests up to ``prefill_chunk`` tokens wide, in groups whose padding to a common
  width wastes little (decode steps and short forced runs together, prompts of similar
  lengths together), each group merged into one forward by the backend's ``run_joint``;
- one chunk of ``prefill_chunk`` tokens of the oldest longer request (a long prompt's
  prefill), so that decoding rows keep moving between its chunks; the request's caller
  waits until its last chunk is done.

Alone, a call forwards directly in its own thread: no lock held, nothing changed.
"""

from __future__ import annotations

import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

__all__ = ["Request", "Scheduler", "Turn", "PREFILL_CHUNK"]

#: Tokens of a prefill forwarded per round while other calls decode.
PREFILL_CHUNK = 512
#: How long a round waits at least for a call that just handed a piece to its consumer
#: (seconds); at most half of the last round's forward: a call that misses a round costs
#: a whole forward later.
GRACE = 0.002
#: The longest a round waits for a call that is still computing its step (seconds).
MAX_WAIT = 0.05


@dataclass(eq=False)
class Request:
    """One call's forward: ``input_ids`` ``[rows, n]`` after ``cache``, as ``Model.forward`` takes it."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    cache: Any
    logits_to_keep: int = 1
    n_real: int | None = None
    holes: bool = True
    done: bool = False
    result: tuple | None = None
    error: BaseException | None = None
    arrived: float = field(default_factory=time.monotonic)

    @property
    def width(self) -> int:
        return self.input_ids.shape[1]

    @property
    def rows(self) -> int:
        return self.input_ids.shape[0]

    def chunk(self, size: int) -> "Request | None":
        """The first ``size`` slots as a request of their own (``None`` when the rest is short enough).

        The last chunk keeps at least ``logits_to_keep`` slots, so its logits are the request's.
        """
        if self.width <= max(size, self.logits_to_keep):
            return None
        size = min(size, self.width - self.logits_to_keep)
        start = self.cache.length if self.cache is not None else 0
        mask = None if self.attention_mask is None else self.attention_mask[:, : start + size]
        return Request(self.input_ids[:, :size], mask, self.cache, 1, None, self.holes)

    def advance(self, size: int, cache) -> None:
        """The first ``size`` slots were forwarded into ``cache``: the request goes on after them."""
        self.input_ids = self.input_ids[:, size:]
        self.cache = cache
        self.n_real = None  # counted again from the mask (or the width) of what is left


class Turn:
    """A call's place in its model's scheduler: running, waiting for a forward, or parked.

    The decoding loop parks its turn while its consumer holds a piece, resumes it when
    asked for the next one, and leaves when it ends (or is collected).
    """

    __slots__ = ("scheduler", "parked", "parked_at", "left", "__weakref__")

    def __init__(self, scheduler: "Scheduler"):
        self.scheduler, self.parked, self.parked_at, self.left = scheduler, False, 0.0, False

    def park(self) -> None:
        """The call waits for its consumer: rounds do not wait for it."""
        self.scheduler._set(self, parked=True)

    def resume(self) -> None:
        """The call computes its next step: it will ask for a forward, or park, or leave."""
        self.scheduler._set(self, parked=False)

    def leave(self) -> None:
        """The call is over."""
        self.scheduler._leave(self)


class Scheduler:
    """Merges the forward passes of the calls running at the same time on one model.

    Parameters
    ----------
    run_one
        ``run_one(request) -> (logits, cache)``: the backend's forward of one request.
    run_joint
        ``run_joint(requests) -> [(logits, cache), ...]``: one forward for several
        requests (each keeps its own cache); ``None`` runs them one after the other.
    prefill_chunk
        Tokens of a long prefill forwarded per round.
    pads
        Whether ``run_joint`` pads requests to a common width (so that requests of very
        different widths run as separate forwards); a backend that sends only real tokens
        (llama.cpp) runs every request of a round in one.
    """

    def __init__(self, run_one: Callable[[Request], tuple] | None, run_joint: Callable[[list], list] | None = None,
                 prefill_chunk: int = PREFILL_CHUNK, pads: bool = True):
        self.run_one, self.run_joint, self.prefill_chunk, self.pads = run_one, run_joint, prefill_chunk, pads
        self.turns: "weakref.WeakSet[Turn]" = weakref.WeakSet()
        self.waiting: list[Request] = []
        self.by_request: dict[int, Turn] = {}  # id(request) -> the turn that sent it
        self.leading = False
        self.last_forward = 0.0  # seconds the last round took
        self.opened = 0.0  # when the last round ended
        self.cond = threading.Condition()
        self.local = threading.local()
        # Worker threads for async calls: each running call holds one while it computes a
        # step, so the pool is large (threads are made only as calls need them).
        self.executor = ThreadPoolExecutor(max_workers=256, thread_name_prefix="continuous-step")

    # -- the calls' side ---------------------------------------------------------------

    def join(self, parked: bool = False) -> Turn:
        """A new call's turn: running (and this thread's current turn), or parked."""
        turn = Turn(self)
        turn.parked, turn.parked_at = parked, time.monotonic()
        with self.cond:
            self.turns.add(turn)
        weakref.finalize(turn, self._collected, weakref.ref(self))
        self.local.turn = None if parked else turn
        return turn

    @staticmethod
    def _collected(ref) -> None:
        scheduler = ref()
        if scheduler is not None:
            with scheduler.cond:
                scheduler.cond.notify_all()

    def _set(self, turn: Turn, parked: bool) -> None:
        with self.cond:
            turn.parked, turn.parked_at = parked, time.monotonic()
            self.local.turn = None if parked else turn
            if parked:  # the calls waiting for a round may stop waiting for this one
                self.cond.notify_all()

    def _leave(self, turn: Turn) -> None:
        with self.cond:
            turn.left = True
            self.turns.discard(turn)
            if getattr(self.local, "turn", None) is turn:
                self.local.turn = None
            self.cond.notify_all()

    def forward(self, request: Request) -> tuple:
        """Run ``request``, merged with the requests of other calls when there are any."""
        turn = getattr(self.local, "turn", None)
        with self.cond:
            alone = not self.waiting and not self.leading and all(t is turn or t.left for t in self.turns)
        if alone and self.run_joint is not None:
            return self._run_chunked(request)
        if self.run_joint is None:
            return self.run_one(request)
        with self.cond:
            self.waiting.append(request)
            if turn is not None:
                self.by_request[id(request)] = turn
            # No wake-up here: only an event makes a round ready (this arrival, a call parking
            # or leaving, a round's end, a deadline), and the thread that causes it checks.
            while not request.done:
                wake = None
                if not self.leading:
                    ready, wake = self._ready()
                    if ready:
                        self._lead()
                        continue
                self.cond.wait(None if wake is None else max(wake - time.monotonic(), 0.0))
            self.by_request.pop(id(request), None)
        if request.error is not None:
            raise request.error
        return request.result

    def _run_chunked(self, request: Request) -> tuple:
        while (part := request.chunk(self.prefill_chunk)) is not None:
            _, cache = self.run_one(part)
            request.advance(part.width, cache)
        return self.run_one(request)

    # -- the leader's side (called with the lock held) ---------------------------------

    def _ready(self) -> tuple[bool, float | None]:
        """Whether every call that will ask for a forward soon has asked (or waited too long);
        if not, when it will be at the latest without another event (``None``: only on an event)."""
        if not self.waiting:
            return False, None
        now = time.monotonic()
        # Waited for since the last round ended (a request that arrived during it waited for it).
        expires = max(self.opened, min(r.arrived for r in self.waiting)) + MAX_WAIT
        if now >= expires:
            return True, None
        asked = {id(t) for t in self.by_request.values()}
        grace = max(GRACE, self.last_forward / 2)
        until = now
        for turn in list(self.turns):
            if turn.left or id(turn) in asked:
                continue
            if not turn.parked:
                return False, expires
            until = max(until, turn.parked_at + grace)
        return (True, None) if until <= now else (False, min(until, expires))

    def _lead(self) -> None:
        """Take a round from the queue, run it without the lock, hand out the results."""
        self.leading = True
        batch, self.waiting = self.waiting, []
        self.cond.release()
        start = time.monotonic()
        try:
            later = self._round(batch)
        finally:
            self.cond.acquire()
            self.leading = False
            self.opened = time.monotonic()
            self.last_forward = self.opened - start
        # What the round did not finish (chunked prefills) goes first in the next one.
        self.waiting = later + self.waiting
        self.cond.notify_all()

    def _round(self, batch: list[Request]) -> list[Request]:
        """Forward each group of requests that pad well together, then a chunk of the oldest long one."""
        groups, wide = split(batch, self.prefill_chunk, self.pads)
        for group in groups:
            self._settle(group, lambda g=group: self.run_joint(g) if len(g) > 1 else [self.run_one(g[0])])
            with self.cond:  # their callers go on while the round forwards the other groups
                self.cond.notify_all()
        if not wide:
            return []
        first = wide[0]
        part = first.chunk(self.prefill_chunk)
        if part is None:
            self._settle([first], lambda: [self.run_one(first)])
        else:
            try:
                _, cache = self.run_one(part)
                first.advance(part.width, cache)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                first.error, first.done = exc, True
        return [r for r in wide if not r.done]

    def _settle(self, requests: list[Request], run: Callable[[], list]) -> None:
        """Run requests together; if that fails, each alone, so one bad request fails only its call."""
        try:
            results = run()
        except BaseException as exc:  # noqa: BLE001 - handed to the callers
            if len(requests) == 1:
                requests[0].error, requests[0].done = exc, True
                return
            for r in requests:
                self._settle([r], lambda r=r: [self.run_one(r)])
            return
        for r, result in zip(requests, results):
            r.result, r.done = result, True


def split(batch: list[Request], chunk: int, pads: bool = True) -> tuple[list[list[Request]], list[Request]]:
    """The groups of requests that each run as one padded forward, and the longer requests, oldest first.

    Requests are padded to the widest of their group; a group takes requests from the
    narrowest up while its padded slots stay at most twice its real ones: on a device
    bound by reading the weights, a few more slots are free, many are not (without
    ``pads``, nothing is padded: one group). Requests wider than ``chunk`` (long
    prefills) are cut into chunks, one per round.
    """
    ordered = sorted((r for r in batch if r.width <= chunk), key=lambda r: (r.width, r.arrived))
    groups: list[list[Request]] = []
    group, rows, slots = [], 0, 0
    for r in ordered:
        if pads and group and (rows + r.rows) * r.width > 2 * (slots + r.rows * r.width):
            groups.append(group)
            group, rows, slots = [], 0, 0
        group.append(r)
        rows, slots = rows + r.rows, slots + r.rows * r.width
    if group:
        groups.append(group)
    wide = sorted((r for r in batch if r.width > chunk), key=lambda r: r.arrived)
    return groups, wide
