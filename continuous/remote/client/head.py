"""The LM head of a client process, shared by its threads: concurrent calls run as one product.

Many sessions of one process (threads of a load test, a server of requests) each
compute logits for their rows; on a CPU, one matrix product over all their rows costs
much less than one per caller. The first caller to find no product running leads; after
a product that had company, it first takes in the calls arriving within a millisecond.
"""

from __future__ import annotations

import threading
import time

import torch

__all__ = ["RowBatcher"]


class _Call:
    """One caller's input to a :class:`RowBatcher`, then its result or error."""

    def __init__(self, x: torch.Tensor):
        self.x, self.result, self.error, self.done = x, None, None, False
        # Inputs are stacked only with inputs of the same kind, run under the same mode.
        self.kind = (x.dtype, x.device, x.shape[-1], torch.is_inference_mode_enabled())


class RowBatcher:
    """Concurrent calls of a row-wise function, made from threads, run as one call.

    The threads of a process serving many sessions (its clients, one per user) then share
    one matrix product instead of one each, as the servers batch their steps. A caller
    that finds no call running leads: it runs the calls queued meanwhile, its own among
    them. When the last run had company, it first takes in the burst of calls arriving
    (until none came for ``gap`` seconds, ``max_wait`` at most), as the sessions of one
    server batch get their replies together. A thread alone runs exactly its own call,
    and waits for no one (but for ``gap`` once, right after it had company).

    Parameters
    ----------
    fn
        The function: each row of its output (all dimensions but the last) depends only
        on the same row of its input.
    max_wait, gap
        Bounds of the wait for company, in seconds.
    """

    def __init__(self, fn, max_wait: float = 0.004, gap: float = 0.001):
        self.fn, self.max_wait, self.gap = fn, max_wait, gap
        self.calls = self.runs = 0  # calls served, and runs of ``fn`` that served them
        lock = threading.Lock()
        self._done = threading.Condition(lock)  # callers wait for their call, or to lead
        self._arrival = threading.Condition(lock)  # a leader waiting for company hears arrivals
        self._queued: list[_Call] = []
        self._running = False
        self._last = 1  # calls taken by the last run

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():  # a result that autograd records is computed alone
            return self.fn(x)
        call = _Call(x)
        with self._done:
            self._queued.append(call)
            self._arrival.notify()
            while not call.done:
                if self._running:
                    self._done.wait()
                else:
                    self._lead()
        if call.error is not None:
            raise call.error
        return call.result

    def _lead(self) -> None:
        """Run the queued calls (the lock is held, and released while they run)."""
        self._running = True
        try:
            if self._last > 1:
                deadline = time.monotonic() + self.max_wait
                while (left := deadline - time.monotonic()) > 0 and self._arrival.wait(min(left, self.gap)):
                    pass
            batch, self._queued = self._queued, []
            self._last = len(batch)
            self._done.release()
            try:
                self._run(batch)
            except BaseException as e:  # an interrupt: no caller of the batch may wait forever
                for other in batch:
                    if not other.done:
                        other.error, other.done = e, True
            finally:
                self._done.acquire()
        finally:
            self._running = False
            self._done.notify_all()

    def _run(self, batch: list[_Call]) -> None:
        kinds: dict[tuple, list[_Call]] = {}
        for call in batch:
            kinds.setdefault(call.kind, []).append(call)
        for kind, calls in kinds.items():
            with torch.inference_mode(kind[-1]), torch.no_grad():
                if len(calls) > 1:
                    try:
                        rows = [call.x.reshape(-1, call.x.shape[-1]) for call in calls]
                        outs = self.fn(torch.cat(rows)).split([len(r) for r in rows])
                    except Exception:  # someone's input is bad: each alone, so that the others get theirs
                        pass
                    else:
                        for call, out in zip(calls, outs):
                            call.result = out.reshape(*call.x.shape[:-1], out.shape[-1])
                        self.runs += 1
                for call in calls:
                    if call.result is None:
                        try:
                            call.result = self.fn(call.x)
                        except Exception as e:
                            call.error = e
                        self.runs += 1
                    call.done = True
            self.calls += len(calls)
