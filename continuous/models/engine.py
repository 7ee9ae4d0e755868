"""One loop owns the step of every call running on a local model.

A model (transformers, llama.cpp) owns one :class:`Engine`. A call is a coroutine
(:meth:`continuous.decode.Decoding.run`) that yields its forwards instead of running
them, and its events (the call prepared, then each step's pieces). The engine keeps the
calls in a table (:mod:`.table`) and steps them all:

1. calls cancelled since the last step are closed (their coroutine ends where it waits:
   between two steps, or between two chunks of its prefill);
2. waiting calls are admitted while their rows and KV bytes fit (:class:`~.table.Table`);
3. every call whose consumer asked for something is advanced: it is sent the reply to its
   last forward and runs its host work until it yields its next forward, its next host
   work (:class:`~.scheduler.Work`: the host work of one kind runs once for every call
   that asks for it), or an event; a piece goes to its consumer and *parks* the call (a
   stream nobody reads holds no step back). Calls whose work says they can be stepped as
   one (their ``tables``: calls at their first step with the same options) are *seated*:
   one new call steps all their rows, and lets each go on once its rows are done
   (:class:`Seat`);
4. the forwards are merged (:mod:`.scheduler`'s policy: groups that pad well, one chunk of
   the oldest long prefill), run by the backend, and each call gets its reply; when a
   merged forward fails, each request runs alone, so that a failure fails only its call.

A step runs on whichever thread drives: a thread waiting for its own call drives while no
other does (a call alone runs on its caller's thread, with no hand-over), and one engine
thread per model drives for async consumers, who await futures the engine sets.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import traceback
import weakref
from typing import Callable, Generator

from .scheduler import PREFILL_CHUNK, Request, Work, answered, split
from .table import ALL, PIECE, READY, Call, Table

__all__ = ["Engine", "DONE", "GRACE"]

logger = logging.getLogger(__name__)

#: What a consumer gets once its call ended.
DONE = "done"
#: How long a step waits at least for a call that just handed a piece to its consumer
#: (seconds); at most half of the last step's forward: a call that misses a step costs a
#: whole forward later.
GRACE = 0.002


class Engine:
    """The step loop of one model's calls.

    Parameters
    ----------
    run_one
        ``run_one(request) -> (logits, cache)``: the backend's forward of one request.
    run_joint
        ``run_joint(requests) -> [(logits, cache), ...]``: one forward for the requests of
        several calls (each keeps its own cache); ``None`` runs them one after the other.
    prefill_chunk
        Tokens of a long prefill forwarded per step.
    pads
        Whether ``run_joint`` pads requests to a common width (see :func:`.scheduler.split`).
    max_rows, max_kv
        Most rows, and KV bytes, the admitted calls may hold; ``None``: no limit.
    token_bytes
        KV bytes one token of one row takes (what ``max_kv`` counts).
    stats
        The model's :class:`~.base.Stats`, where each step is recorded.
    on_leave
        ``on_leave(call_id)``: called once a call ended (the backend forgets its rows).
    """

    def __init__(self, run_one: Callable, run_joint: Callable | None = None, *, prefill_chunk: int = PREFILL_CHUNK,
                 pads: bool = True, max_rows: int | None = None, max_kv: int | None = None, token_bytes: int = 0,
                 stats=None, on_leave: Callable[[int], None] | None = None):
        self.run_one, self.run_joint, self.prefill_chunk, self.pads = run_one, run_joint, prefill_chunk, pads
        self.table = Table(max_rows, max_kv)
        self.token_bytes, self.stats, self.on_leave = token_bytes, stats, on_leave
        self.cond = threading.Condition()
        self.driving = False
        self.last_forward = 0.0
        self.host = 0.0  # host seconds since the last step that forwarded
        self.woken: list = []  # (event loop, future) of async consumers to tell (see _tell)
        # Per event loop, the asks of its consumers not yet made (see _ask_later); weakly, as a loop
        # closed before it ran them never will.
        self._asked: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.thread: threading.Thread | None = None

    # -- direct forwards ---------------------------------------------------------------

    def forward(self, request: Request) -> tuple:
        """Run one request now, on this thread, outside any call's step (a long one in chunks)."""
        while (part := request.chunk(self.prefill_chunk)) is not None:
            _, cache = self.run_one(part)
            request.advance(part.width, cache)
        return self.run_one(request)

    # -- the consumers' side -------------------------------------------------------------

    def kv_bytes(self, rows: int, tokens: int) -> int:
        """The KV bytes ``rows`` rows of ``tokens`` tokens take."""
        return rows * tokens * self.token_bytes

    def check(self, rows: int, tokens: int) -> None:
        """Refuse now a call of ``rows`` rows up to ``tokens`` tokens long that could never run."""
        self.table.check(rows, self.kv_bytes(rows, tokens))

    def submit(self, steps: Generator, rows: int, tokens: int = 0) -> Call:
        """Queue a call (its coroutine); it is admitted at a step where it fits."""
        with self.cond:
            call = self.table.add(steps, rows, self.kv_bytes(rows, tokens))
            self._gauges()
            return call

    def running(self) -> int:
        """How many admitted calls step: a call whose rows another call steps (see :meth:`_seat`)
        counts in that one."""
        return self.table.stepping

    def next(self, call: Call, what: str = PIECE):
        """Wait for what the consumer asks of ``call``: a piece, :data:`READY`, or (with
        ``ALL``) its end; returns it, or :data:`DONE` once the call ended. Raises the call's error.

        The calling thread drives the steps while no other thread does.
        """
        self.ask(call, what)
        self._drive_until(lambda: self._answer_ready(call, what), call)
        with self.cond:
            return self._answer(call, what)

    async def anext(self, call: Call, what: str = PIECE):
        """:meth:`next` for asyncio: the engine thread drives; the answer comes with no thread hop."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self.cond:
            if self._answer_ready(call, what):
                future.set_result(None)
            else:
                call.wakers.append((loop, future))
                self._ask_later(loop, call, what)
        await future
        with self.cond:
            return self._answer(call, what)

    def cancel(self, call: Call) -> None:
        """Stop ``call`` at the next step (or between two chunks of its prefill); nobody waits for it."""
        with self.cond:
            if call.done:
                return
            call.cancelled = True
        self._wake_thread()  # it ends at the next step, whoever consumes it

    def close(self, call: Call) -> None:
        """Cancel ``call`` and wait until it ended (driving, if no other thread does)."""
        self.cancel(call)
        self._drive_until(lambda: call.done, call)

    async def aclose(self, call: Call) -> None:
        """Cancel ``call`` and wait until it ended."""
        if not call.done:
            self.cancel(call)
            await self.anext(call, ALL)

    def ask(self, call: Call, what: str = PIECE) -> None:
        """Ask ``call`` for a piece, :data:`READY` or ``ALL`` without waiting: the next step
        advances it (a call holding an untaken piece, or asked for more already, is left as it is)."""
        with self.cond:
            self._ask(call, what)

    def _ask(self, call: Call, what: str, wake: bool = True) -> None:
        if (what == PIECE and call.events) or _ORDER.get(call.demand, 0) >= _ORDER[what]:
            return
        call.demand = what
        if wake:
            self.cond.notify_all()

    def _ask_later(self, loop: asyncio.AbstractEventLoop, call: Call, what: str) -> None:
        """Ask for ``call`` once the tasks of ``loop`` ready now have run (with the lock held): the calls
        that a burst (``asyncio.gather``) submits together start together, in one prefill, not the
        first alone while the others are still being tokenized; and the streams handed a piece by a
        step ask for the next one together, with one lock and one wake of the engine, not one each."""
        if loop not in self._asked:
            self._asked[loop] = []
            loop.call_soon(self._ask_all, loop)
        self._asked[loop].append((call, what))

    def _ask_all(self, loop: asyncio.AbstractEventLoop) -> None:
        """Make the asks :meth:`_ask_later` kept for ``loop``, then wake the engine thread once."""
        with self.cond:
            for call, what in self._asked.pop(loop, ()):
                self._ask(call, what, wake=False)
            self._wake_thread()

    def _wake_thread(self) -> None:
        """Start or wake the engine thread: async consumers wait for a step."""
        with self.cond:
            self._start_thread()
            self.cond.notify_all()

    def _answer_ready(self, call: Call, what: str) -> bool:
        return call.done or (what == PIECE and bool(call.events)) or (what == READY and call.ready)

    def _answer(self, call: Call, what: str):
        if what == PIECE and call.events:
            return call.events.popleft()
        if call.error is not None:
            raise call.error
        if what == READY and call.ready and not call.done:
            return READY
        return DONE

    # -- driving -----------------------------------------------------------------------

    def _drive_until(self, done: Callable[[], bool], own: Call) -> None:
        """Drive steps while no other thread does, until ``done()`` (checked under the lock);
        ``own`` is the call this thread consumes (no step waits for it to ask)."""
        with self.cond:
            while not done():
                if self.driving or not self._has_work():
                    self.cond.wait()
                    continue
                self._round(own)

    def _start_thread(self) -> None:
        """The engine thread, which drives for async consumers (started once per model)."""
        if self.thread is None:
            self.thread = threading.Thread(target=self._serve, name="continuous-engine", daemon=True)
            self.thread.start()

    def _serve(self) -> None:
        with self.cond:
            while True:
                if self.driving or not self._has_work():
                    self.cond.wait()
                    continue
                try:
                    self._round()
                except BaseException as exc:  # noqa: BLE001 - a defect of the step itself: no call may hang on it
                    logger.exception("the engine's step failed: its calls fail with its error")
                    self._fail_all(exc)

    def _fail_all(self, error: BaseException) -> None:
        """End every call with ``error`` (with the lock held): the step itself failed."""
        for call in list(self.table.calls.values()) + list(self.table.waiting):
            call.done, call.error, call.request, call.work, call.demand = True, error, None, None, None
            self.table.remove(call)
            self._wake(call)
        self._tell()
        self._gauges()
        self.cond.notify_all()

    def _round(self, own: Call | None = None) -> None:
        """One step, driven by this thread (called with the lock held; released while stepping)."""
        self.driving = True
        self._linger(own)
        self.cond.release()
        try:
            self._step(linger=True, own=own)
        finally:
            self.cond.acquire()
            self.driving = False
            self.cond.notify_all()

    def _linger(self, own: Call | None = None) -> None:
        """Wait (briefly) for calls that just handed a piece and will ask for the next one soon:
        missing the step costs them a whole forward. Not for ``own``, the call of the thread that
        drives: its consumer asks only once the step is over. Called with the lock held."""
        grace = max(GRACE, min(self.last_forward / 2, 0.02))
        while True:
            late = [c.handed_at for c in self.table.calls.values()
                    if c.demand is None and not c.done and not c.cancelled and c.request is None and c is not own]
            left = max(late, default=0.0) + grace - time.monotonic()
            if left <= 0:
                return
            self.cond.wait(left)

    def _has_work(self) -> bool:
        """Whether a step would do anything (with the lock held)."""
        table = self.table
        if table.waiting and (table.waiting[0].cancelled or table.fits(table.waiting[0])):
            return True
        return any(c.cancelled or c.request is not None or c.work is not None
                   or (c.demand is not None and c.seat is None) for c in table.calls.values())

    # -- the step ----------------------------------------------------------------------

    def step(self) -> bool:
        """One step of every call: close the cancelled, admit, advance, forward. Returns
        whether anything happened. Only one thread steps at a time: this one waits while
        another drives."""
        with self.cond:
            while self.driving:
                self.cond.wait()
            self.driving = True
        try:
            return self._step()
        finally:
            with self.cond:
                self.driving = False
                self.cond.notify_all()

    def _step(self, linger: bool = False, own: Call | None = None) -> bool:
        """The step (see :meth:`step`). With ``linger``, the consumers handed a piece by this step
        (but ``own``'s, whose thread drives) get a moment to ask for the next one, so that their
        calls join this step's forward: else each token of a stream would take two steps, and
        streams would fall into two cohorts that forward in turns, each with half the rows."""
        began = time.perf_counter()
        with self.cond:
            for call in list(self.table.waiting):
                if call.cancelled:
                    self._end(call, None)
            self.table.admit()
            calls = list(self.table.calls.values())
        moved = False
        for call in calls:
            if call.cancelled:
                self._close(call)
                moved = True
            elif call.asks:
                self._advance(call)
                moved = True
        ran = self._work(calls)
        calls = list(self.table.calls.values())  # with the calls seating made (only this thread adds any)
        with self.cond:
            self._tell()  # before the step waits for them to ask again, and before the forward
        if ran:
            moved = True
            if linger:
                waited = time.perf_counter()
                with self.cond:
                    self._linger(own)
                began += time.perf_counter() - waited  # waiting is no host work
        for call in calls:
            if call.asks:  # asked again while the step waited, or let go by its table: joins this step's forward
                self._advance(call)
        requests = [c.request for c in calls if not c.done and c.request is not None]
        if self.woken:
            with self.cond:
                self._tell()
        # Host work counts toward the next step that forwards (a step that only hands pieces out
        # did the sampling of the step its consumers ask for next).
        self.host += time.perf_counter() - began
        if requests:
            began = time.perf_counter()
            self._forward(requests)
            self.last_forward = time.perf_counter() - began
            if self.stats is not None:
                self.stats.record_step(sum(r.batch_rows for r in requests), self.host, self.last_forward)
            self.host = 0.0
        with self.cond:
            self._tell()
            self._gauges()
            self.cond.notify_all()
        return moved or bool(requests)

    def _advance(self, call: Call) -> None:
        """Run the call's host work until it yields a forward (kept for the step) or parks."""
        while True:
            reply, call.reply = call.reply, None
            then, call.then = call.then, None
            try:
                if reply is not None and reply[1] is not None:
                    item = call.steps.throw(reply[1])
                elif then is not None:
                    # The answer makes the call's next draw at once: the call takes the draw's result,
                    # with no turn of its loop for the answer alone.
                    try:
                        item = then(*reply[0])
                    except BaseException as exc:  # noqa: BLE001 - the call's own failure, raised where it waits
                        item = call.steps.throw(exc)
                else:
                    item = call.steps.send(None if reply is None else reply[0])
            except StopIteration:
                self._end(call, None)
                return
            except BaseException as exc:  # noqa: BLE001 - the call's own failure, handed to its consumer
                # The error keeps its traceback, not the call's locals: its caches (a llama.cpp
                # sequence, KV memory) are freed now, not when the consumer drops the error.
                traceback.clear_frames(exc.__traceback__)
                self._end(call, exc)
                return
            if isinstance(item, Request):
                item.call, call.request = call.id, item
                call.start = item.cache.length if item.cache is not None else 0
                return
            if isinstance(item, Work):
                call.work = item
                return
            if item != READY and call.first_piece_at is None:
                call.first_piece_at = time.monotonic()
                for guest in call.guests:  # their first tokens came with this piece
                    guest.first_piece_at = guest.first_piece_at or call.first_piece_at
            if item != READY and call.demand == ALL and not call.cancelled:
                continue  # the piece is dropped; no lock: nothing lowers a demand of ALL but this thread
            with self.cond:
                if item == READY:
                    call.ready = True
                    if call.demand != READY:
                        continue
                elif call.demand == PIECE:
                    call.events.append(item)
                    call.handed_at = time.monotonic()
                elif not call.cancelled:
                    continue  # ALL: the piece is dropped
                call.demand = None
                self._wake(call)
                return

    def _work(self, calls: list[Call]) -> bool:
        """Run the host work the calls wait for, the items of one key together, and advance each
        call with its result (until its forward, its next event, or more work: run in turn, as
        long as some call asks for it). Returns whether any ran."""
        ran = False
        while True:
            groups: dict = {}
            for call in calls:
                if call.work is not None and not call.done and not call.cancelled:
                    key = call.work.key
                    if key in groups:
                        groups[key].append(call)
                    else:
                        groups[key] = [call]
            if not groups:
                return ran
            ran = True
            calls = []  # only a call advanced here may ask for more work
            for group in groups.values():
                group, hosts = self._seat_all(group)
                items = [c.work for c in group]
                for call in group:
                    call.work = None
                for call, reply in zip(group, _together(items) if items else []):
                    call.reply = reply
                    self._advance(call)
                calls += group + hosts

    def _seat_all(self, group: list[Call]) -> tuple[list[Call], list[Call]]:
        """Seat the calls of a group of work whose rows one call can step as its own (the work's
        ``tables(items)``: ``(indices, make)`` per such set of items, ``make(seats)`` giving the
        coroutine that steps them); returns the calls left, and the new calls, advanced."""
        tables = getattr(type(group[0].work), "tables", None)
        if tables is None or len(group) < 2:
            return group, []
        seated, hosts = set(), []
        for indices, make in tables([c.work for c in group]):
            guests = [group[i] for i in indices]
            try:
                steps = make([Seat(self, guest) for guest in guests])
            except Exception:  # noqa: BLE001 - they step on their own, as they would have
                logger.exception("calls could not be stepped as one: each steps on its own")
                continue
            for guest in guests:
                guest.work = None
            seated.update(indices)
            hosts.append(self._seat(guests, steps))
        return [c for i, c in enumerate(group) if i not in seated], hosts

    def _seat(self, guests: list[Call], steps: Generator) -> Call:
        """A new call, ``steps``, that steps the rows of ``guests`` (see :meth:`.table.Table.seat`),
        advanced to its first work."""
        with self.cond:
            host = self.table.seat(steps, guests)
            self._gauges()
        self._advance(host)
        return host

    def _let_go(self, guest: Call, value, error: BaseException | None) -> None:
        """The call stepping ``guest``'s rows is done with them: ``guest`` goes on with ``value``
        (or ``error``)."""
        guest.reply, guest.then = (value, error), None
        with self.cond:
            self.table.let_go(guest)

    def _close(self, call: Call) -> None:
        """End a cancelled call where its coroutine waits; its pending forward is dropped."""
        call.work = None
        request, call.request = call.request, None
        if request is not None and request.cache is not None and call.start and request.cache.length > call.start:
            request.cache.release(call.start)  # a prefill cut between chunks: its slots go back
        try:
            call.steps.close()
        except BaseException as exc:  # noqa: BLE001 - handed to its consumer
            self._end(call, exc)
            return
        self._end(call, None)

    def _end(self, call: Call, error: BaseException | None) -> None:
        if self.on_leave is not None:  # before its consumer hears of it: the backend holds none of its rows
            try:
                self.on_leave(call.id)
            except Exception:  # noqa: BLE001 - its rows stay where they are: still right, only not freed
                logger.exception("the backend could not let go of a call's rows")
        with self.cond:
            call.done, call.error, call.request, call.demand = True, error, None, None
            self.table.remove(call)
            call.guests = []  # no cycle of calls outlives them
            self._gauges()
            self._wake(call)
            self.cond.notify_all()

    def _wake(self, call: Call) -> None:
        """Tell the call's async consumers (with the lock held), at the step's next :meth:`_tell`."""
        if call.wakers:
            self.woken += call.wakers
            call.wakers = []

    def _tell(self) -> None:
        """Tell the async consumers woken since the last time (with the lock held): one hand-over to
        each event loop, not one per call (each wakes the loop's thread)."""
        woken, self.woken = self.woken, []
        loops: dict = {}
        for loop, future in woken:
            loops.setdefault(loop, []).append(future)
        for loop, futures in loops.items():
            try:
                loop.call_soon_threadsafe(_resolve, futures)
            except RuntimeError:  # its loop is closed: nobody is there to tell
                pass

    def _forward(self, requests: list[Request]) -> None:
        """The merged forwards of a step: each group that pads well, then a chunk of the oldest long one."""
        groups, wide = split(requests, self.prefill_chunk, self.pads)
        for group in groups:
            run = (lambda g=group: self.run_joint(g)) if len(group) > 1 and self.run_joint else None
            self._settle(group, run)
        if not wide:
            return
        first = wide[0]
        part = first.chunk(self.prefill_chunk)
        if part is None:
            self._settle([first], None)
            return
        try:
            _, cache = self.run_one(part)
        except BaseException as exc:  # noqa: BLE001 - handed to its call
            self._reply(first, None, exc)
            return
        first.advance(part.width, cache)  # the call's next step forwards the next chunk (unless cancelled)

    def _settle(self, requests: list[Request], run: Callable[[], list] | None) -> None:
        """Run requests together (``run``), or each alone; when together fails, each alone, so
        that one bad request fails only its call."""
        if run is not None:
            try:
                results = run()
            except BaseException:  # noqa: BLE001 - each request again, alone
                pass
            else:
                for r, result in zip(requests, results):
                    self._reply(r, result, None)
                return
        for r in requests:
            try:
                result = self.run_one(r)
            except BaseException as exc:  # noqa: BLE001 - handed to its call
                self._reply(r, None, exc)
            else:
                self._reply(r, result, None)

    def _reply(self, request: Request, result, error) -> None:
        call = self.table.calls.get(request.call)
        if call is not None:
            call.request, call.reply = None, (None if result is None else answered(request, *result), error)
            call.then = request.then if error is None else None

    def _gauges(self) -> None:
        if self.stats is not None:
            # A call stepping others' rows is none of its callers'.
            self.stats.set_gauges(calls_running=len(self.table.calls) - self.table.hosts,
                                  calls_waiting=len(self.table.waiting),
                                  rows_in_use=self.table.rows, kv_bytes_in_use=self.table.kv)


class Seat:
    """What the call stepping another call's rows (its guest) knows of the guest, and how it lets go."""

    def __init__(self, engine: Engine, guest: Call):
        self._engine, self._guest = engine, guest

    @property
    def gone(self) -> bool:
        """The guest ended (it was cancelled or closed): nobody reads its rows."""
        return self._guest.done or self._guest.cancelled

    def let_go(self, value=None, error: BaseException | None = None) -> None:
        """The guest's rows are done: its coroutine goes on, at this step, sent ``value`` (or
        thrown ``error``)."""
        self._engine._let_go(self._guest, value, error)


def _together(items: list[Work]) -> list[tuple]:
    """``(result, error)`` of each item, run together; when together fails, each alone, so that
    one bad item fails only its call."""
    try:
        return [(result, None) for result in type(items[0]).run_all(items)]
    except BaseException as exc:  # noqa: BLE001 - each again, alone
        if len(items) == 1:
            return [(None, exc)]
    return [_together([item])[0] for item in items]


#: What a consumer may ask, from least to most: a call asked for more keeps going.
_ORDER = {READY: 1, PIECE: 2, ALL: 3}


def _resolve(futures: list[asyncio.Future]) -> None:
    for future in futures:
        if not future.done():
            future.set_result(None)
