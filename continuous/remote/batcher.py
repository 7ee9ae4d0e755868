"""The compute thread of a server: steps of concurrent sessions run as one forward.

Sessions submit steps from the event loop; one thread takes everything queued (waiting
after the first for the other open sessions' steps, up to ``max_wait`` seconds, or
``window`` seconds when it is alone), groups the steps that can
share a forward (same blocks, same number of new tokens) and runs each group with
:meth:`Blocks.step_batch`. Groups run in the order of their first step, so no session
waits for more than one round of others; long prefills arrive in chunks (the handler
cuts them), so they cannot hold off the decode steps of other sessions for long.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass

import torch

from continuous.remote.backend import Blocks, Step

logger = logging.getLogger(__name__)


@dataclass
class _Job:
    start: int
    end: int
    step: Step
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop

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
        Seconds to wait after a first step for others to join its batch.
    max_rows
        Most rows of one batched forward.
    max_wait
        Longest wait after a first step while other sessions are open: their steps
        usually follow within a few milliseconds, and one forward for all of them costs
        little more than one for a single step.
    expected
        Returns how many sessions are open (the most steps a round can gather).
    """

    def __init__(self, blocks: Blocks, window: float = 0.002, max_rows: int = 64, max_wait: float = 0.01,
                 expected=lambda: 1):
        self.blocks, self.window, self.max_rows = blocks, window, max_rows
        self.max_wait, self.expected = max_wait, expected
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self.batches = 0  # forwards run, and steps they served: for tests and logs
        self.steps = 0
        self._thread = threading.Thread(target=self._run, name="continuous-compute", daemon=True)
        self._thread.start()

    async def submit(self, start: int, end: int, step: Step) -> torch.Tensor:
        """Run ``step`` over blocks ``start:end`` (batched with others); return its output."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._queue.put(_Job(start, end, step, future, loop))
        return await future

    def _take(self) -> list[_Job] | None:
        first = self._queue.get()
        if first is None:
            return None
        jobs = [first]
        expected = self.expected()
        deadline = time.monotonic() + (self.max_wait if expected > 1 else self.window)
        while True:
            try:
                if len(jobs) >= expected:  # every open session is in: take what is queued, no waiting
                    job = self._queue.get_nowait()
                else:
                    job = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return jobs
            if job is None:
                self._queue.put(None)  # stop after this round
                return jobs
            jobs.append(job)

    def _run(self) -> None:
        while (jobs := self._take()) is not None:
            groups: dict[tuple, list[_Job]] = {}  # insertion order: the order of first arrival
            for job in jobs:
                key = (job.start, job.end, job.step.hidden.shape[1])
                group = groups.setdefault(key, [[]])
                if sum(j.step.hidden.shape[0] for j in group[-1]) + job.step.hidden.shape[0] > self.max_rows:
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
        for job, out in zip(batch, outs):
            job.resolve(out)

    def shutdown(self) -> None:
        """Finish the queued steps and stop the thread."""
        self._queue.put(None)
        self._thread.join(timeout=30)
