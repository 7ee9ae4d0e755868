"""The compute thread of a server: steps of concurrent sessions run as one forward.

Sessions submit steps from the event loop; one thread takes everything queued, groups the
steps that can share a forward (the same blocks; any rows and numbers of new tokens, up to
``max_tokens`` in all) and runs each group with :meth:`Blocks.step_batch`. After the first
step of a round it waits, up to ``max_wait`` seconds, for the sessions that are
*mid-flight*: those that stepped before, whose last step is done, and whose next step is
due soon going by their own pace (the time they usually take between a reply and their
next step), and for no more than half of them: under load the sessions of a server then
fall into two groups that share a forward each and take turns, a pipeline through the
chain of servers and the clients. A session that pauses is not waited for once it is
overdue, and a session alone never waits. Groups run in the order of their first step, so
no session waits for more than one round of others; long prefills arrive in chunks (the
handler cuts them), so they cannot hold off the decode steps of other sessions for long.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass

import torch

from continuous.remote.server.blocks import Blocks, Step

logger = logging.getLogger(__name__)


class _Pace:
    """When a session's last step was done, and how long it usually takes to send the next."""

    def __init__(self):
        self.done: float | None = None  # None while a step of the session is queued or computing
        self.gap: float | None = None  # moving average of seconds from a step done to the next step

    def due(self, slack: float) -> tuple[float, float] | None:
        """When the session's next step is expected, and when it is overdue (None: not expected)."""
        done, gap = self.done, self.gap
        return None if done is None or gap is None else (done + gap, done + 2 * gap + slack)


@dataclass
class _Job:
    start: int
    end: int
    step: Step
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    pace: _Pace | None = None

    @property
    def tokens(self) -> int:
        return self.step.hidden.shape[0] * self.step.hidden.shape[1]

    def resolve(self, result=None, error: BaseException | None = None) -> None:
        def set_():
            if not self.future.done():
                if error is not None:
                    self.future.set_exception(error)
                else:
                    self.future.set_result(result)

        self.loop.call_soon_threadsafe(set_)


class Batcher:
    """One compute thread serving all sessions of a server, batching their steps.

    Parameters
    ----------
    blocks
        The loaded blocks.
    window
        Slack, in seconds, on when a mid-flight session's next step is due.
    max_tokens
        Most new tokens (rows times positions) of one batched forward; a step larger than
        that runs alone.
    max_wait
        Longest wait after a first step for the steps of mid-flight sessions: one forward
        for many of them costs little more than one for a single step, so when the cores
        are busy anyway, waiting for them saves compute.
    groups
        A round waits for at most ``1/groups`` of the sessions that keep stepping. With
        two groups, the sessions going through a chain of servers form a pipeline: one
        group runs here while the other runs on the next server or on its clients, instead
        of every stage idling while one forward serves all of them.
    """

    def __init__(self, blocks: Blocks, window: float = 0.002, max_tokens: int = 256, max_wait: float = 0.1,
                 groups: int = 2):
        self.blocks, self.window, self.max_tokens = blocks, window, max_tokens
        self.max_wait, self.groups = max_wait, groups
        self._paces: dict[object, _Pace] = {}  # session -> its pace, while it is open
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self.batches = 0  # forwards run, and steps they served: for tests and logs
        self.steps = 0
        self._thread = threading.Thread(target=self._run, name="continuous-compute", daemon=True)
        self._thread.start()

    async def submit(self, start: int, end: int, step: Step, session: object = None) -> torch.Tensor:
        """Run ``step`` over blocks ``start:end`` (batched with others); return its output.

        ``session`` (any hashable, until :meth:`forget`) lets the batcher learn the
        session's pace and wait for its steps when it is mid-flight.
        """
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        pace = None
        if session is not None:
            pace = self._paces.setdefault(session, _Pace())
            if pace.done is not None:
                gap = time.monotonic() - pace.done
                pace.gap = gap if pace.gap is None else (pace.gap + gap) / 2
            pace.done = None
        self._queue.put(_Job(start, end, step, future, loop, pace))
        return await future

    def forget(self, session: object) -> None:
        """The session is closed: no step of it is expected any more."""
        self._paces.pop(session, None)

    def _take(self) -> list[_Job] | None:
        first = self._queue.get()
        if first is None:
            return None
        jobs = [first]
        now = time.monotonic()
        paces = list(self._paces.values())
        # Wait for the mid-flight sessions expected within max_wait, until the last of them
        # is overdue, but for no more than 1/groups of the sessions that keep stepping.
        dues = {id(pace): due[1] for pace in paces
                if (due := pace.due(self.window)) is not None and due[0] <= now + self.max_wait and due[1] > now}
        deadline = min(now + self.max_wait, max(dues.values(), default=now))
        enough = -(-sum(pace.gap is not None for pace in paces) // self.groups)
        while True:
            try:
                if not dues or len(jobs) >= enough:  # take what is queued, no waiting
                    job = self._queue.get_nowait()
                else:
                    job = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return jobs
            if job is None:
                self._queue.put(None)  # stop after this round
                return jobs
            jobs.append(job)
            dues.pop(id(job.pace), None)

    def _run(self) -> None:
        while (jobs := self._take()) is not None:
            groups: dict[tuple, list[list[_Job]]] = {}  # insertion order: the order of first arrival
            for job in jobs:
                group = groups.setdefault((job.start, job.end), [[]])
                if group[-1] and sum(j.tokens for j in group[-1]) + job.tokens > self.max_tokens:
                    group.append([])
                group[-1].append(job)
            for batches in groups.values():
                for batch in batches:
                    self._forward(batch)

    def _forward(self, batch: list[_Job]) -> None:
        ready = []
        for job in batch:
            # Room first, for each session alone: one whose cache cannot grow fails by
            # itself, before anything of the batch has changed.
            try:
                job.step.cache.reserve(job.step.hidden.shape[0], job.step.start_position + job.step.hidden.shape[1])
            except BaseException as e:
                job.resolve(error=e)
            else:
                ready.append(job)
        if not ready:
            return
        try:
            outs = self.blocks.step_batch(ready[0].start, ready[0].end, [job.step for job in ready])
        except BaseException as e:
            logger.warning("a batch of %d steps failed: %r", len(ready), e)
            for job in ready:
                job.resolve(error=e)
            return
        batch = ready
        self.batches += 1
        self.steps += len(batch)
        done = time.monotonic()
        for job, out in zip(batch, outs):
            if job.pace is not None:
                job.pace.done = done
            job.resolve(out)

    def shutdown(self) -> None:
        """Finish the queued steps and stop the thread."""
        self._queue.put(None)
        self._thread.join(timeout=30)
