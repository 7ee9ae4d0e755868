"""The engine's step, driven by hand with a fake backend: joins, leaves, parking, cancellation,
admission and failures, with no clock and no thread."""

import asyncio
import threading

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from continuous.models import engine as engine_module
from continuous.models.base import Stats
from continuous.models.engine import DONE, Engine
from continuous.models.scheduler import Request, Work
from continuous.models.table import ALL, PIECE, READY


class _Cache:
    def __init__(self, length):
        self.length, self.released = length, None

    def release(self, length):
        self.released = length


class _Backend:
    """Records each forward as the call ids and widths it ran; fails where a request's ids hold -1."""

    def __init__(self):
        self.forwards = []
        self.failed = set()  # the indices in ``forwards`` of those that failed

    def _result(self, r):
        if bool((r.input_ids == -1).any()):
            self.failed.add(len(self.forwards) - 1)
            raise RuntimeError("bad request")
        start = r.cache.length if r.cache is not None else 0
        return torch.zeros((r.batch_rows, r.logits_to_keep, 4)), _Cache(start + r.width)

    def run_one(self, r):
        self.forwards.append([(r.call, r.width)])
        return self._result(r)

    def run_joint(self, requests):
        self.forwards.append([(r.call, r.width) for r in requests])
        return [self._result(r) for r in requests]


def _call(name, prompt, steps, log, bad_at=None):
    """A call's coroutine: its prefill, READY, then per step a piece and a one-token forward."""
    try:
        _, cache = yield Request(torch.zeros((1, prompt), dtype=torch.long), None, None)
        yield READY
        for i in range(steps):
            yield [f"{name}{i}"]
            token = -1 if i == bad_at else 0
            _, cache = yield Request(torch.full((1, 1), token), None, cache)
        yield [f"{name}-end"]
    finally:
        log.append(name)


@pytest.fixture
def backend():
    return _Backend()


def _engine(backend, **options):
    left = []
    engine = Engine(backend.run_one, backend.run_joint, on_leave=left.append, **options)
    engine._start_thread = lambda: None  # driven by hand: no engine thread steps behind the test
    return engine, left


def _take(call):
    return call.events.popleft() if call.events else None


def test_a_call_joins_at_the_next_step_and_leaves_when_it_ends(backend):
    engine, left = _engine(backend)
    log = []
    a = engine.submit(_call("a", 3, 3, log), rows=1)
    engine.ask(a, ALL)
    engine.step()  # a's prefill
    assert backend.forwards == [[(a.id, 3)]]
    b = engine.submit(_call("b", 2, 1, log), rows=1)
    engine.ask(b, ALL)
    engine.step()  # b's prefill and a's first token: one merged forward (they pad well)
    assert backend.forwards[-1] == [(a.id, 1), (b.id, 2)] or backend.forwards[-1] == [(b.id, 2), (a.id, 1)]
    engine.step()
    assert sorted(backend.forwards[-1]) == sorted([(a.id, 1), (b.id, 1)])
    engine.step()  # b ends; a forwards its last token alone
    assert b.done and b.error is None and left == [b.id] and log == ["b"]
    assert backend.forwards[-1] == [(a.id, 1)]
    engine.step()
    assert a.done and left == [b.id, a.id] and not engine.table.calls and engine.table.rows == 0


def test_the_calls_of_an_asyncio_burst_start_together_in_one_prefill(backend):
    """Calls that ``asyncio.gather`` submits together are asked for only once every task ready then
    has run: an engine that steps the moment it is woken (as a running engine thread does) still
    forwards their prompts as one, not the first alone while the others are being submitted."""
    engine, _ = _engine(backend)
    engine._start_thread = engine.step  # woken, it steps at once
    log = []

    async def consumer(name):
        call = engine.submit(_call(name, 3, 2, log), rows=1)
        await engine.anext(call, ALL)
        return call

    async def burst():
        tasks = [asyncio.ensure_future(consumer(name)) for name in "abc"]
        while not all(task.done() for task in tasks):
            await asyncio.sleep(0)
            engine.step()
        return [task.result() for task in tasks]

    calls = asyncio.run(burst())
    assert sorted(backend.forwards[0]) == [(call.id, 3) for call in calls]  # one prefill of the three
    assert all(sorted(f) == [(call.id, 1) for call in calls] for f in backend.forwards[1:])
    assert len(backend.forwards) == 3 and sorted(log) == ["a", "b", "c"]


def test_the_consumers_that_ask_in_one_turn_of_their_event_loop_wake_the_engine_once(backend):
    """The streams handed a piece by a step ask for the next one in one turn of their event loop:
    their asks are made together, once every task ready then has run, with one wake of the engine
    (each waking it would have it check, and wait again, once per stream)."""
    engine, _ = _engine(backend)
    calls = [engine.submit(_call(name, 2, 2, []), rows=1) for name in "abc"]
    wakes = []
    engine._start_thread = lambda: wakes.append([c.demand for c in calls])

    async def turns():
        tasks = [asyncio.ensure_future(engine.anext(c, PIECE)) for c in calls]
        for _ in range(3):
            await asyncio.sleep(0)
        assert wakes == [[PIECE] * 3]  # asked together, then woken once
        while not all(t.done() for t in tasks):
            engine.step()
            await asyncio.sleep(0)
        return [t.result() for t in tasks]

    assert asyncio.run(turns()) == [["a0"], ["b0"], ["c0"]]
    assert len(wakes) == 1


def test_a_consumer_whose_event_loop_is_closed_holds_no_step_back(backend):
    """A call whose async consumer's loop closed (the consumer gave up) ends as the others do: there is
    nobody to tell, and the step goes on."""
    engine, _ = _engine(backend)
    gone, here = (engine.submit(_call(name, 2, 2, []), rows=1) for name in ("gone", "here"))
    closed = asyncio.new_event_loop()
    gone.wakers.append((closed, closed.create_future()))
    closed.close()
    engine.ask(gone, ALL)
    engine.ask(here, ALL)
    while not (gone.done and here.done):
        engine.step()
    assert gone.error is None and here.error is None and not engine.woken


def test_a_call_whose_consumer_holds_a_piece_is_parked_and_holds_nobody_back(backend):
    engine, _ = _engine(backend)
    log = []
    slow = engine.submit(_call("slow", 2, 5, log), rows=1)
    fast = engine.submit(_call("fast", 2, 3, log), rows=1)
    engine.ask(slow, PIECE)
    engine.ask(fast, ALL)
    engine.step()  # both prefills
    engine.step()  # slow hands its first piece and parks; fast forwards its first token
    assert _take(slow) == ["slow0"] and slow.demand is None and slow.request is None
    for _ in range(4):
        engine.step()
    assert fast.done and not slow.done
    assert all(slow.id not in [c for c, _ in f] for f in backend.forwards[2:])  # never waited for, never forwarded
    engine.ask(slow, PIECE)  # the consumer comes back: the call goes on where it was
    engine.step()
    assert backend.forwards[-1] == [(slow.id, 1)]
    engine.step()  # its next piece is computed from that forward's logits
    assert _take(slow) == ["slow1"] and len(backend.forwards) == 5  # parked again: nothing to forward


def test_a_call_cancelled_between_the_chunks_of_its_prefill_leaves_and_is_never_forwarded_again(backend):
    engine, left = _engine(backend, prefill_chunk=4)
    log = []
    long = engine.submit(_call("long", 11, 2, log), rows=1)
    other = engine.submit(_call("other", 2, 6, log), rows=1)
    engine.ask(long, ALL)
    engine.ask(other, ALL)
    engine.step()  # other's prefill, and the long prompt's first chunk
    assert sorted(backend.forwards) == sorted([[(other.id, 2)], [(long.id, 4)]])
    engine.cancel(long)
    assert not long.done  # nothing waits for it: it ends at the next step
    engine.step()
    assert long.done and long.error is None and log == ["long"] and left == [long.id]
    assert backend.forwards[-1] == [(other.id, 1)]
    for _ in range(8):
        engine.step()
    assert other.done
    forwarded = sum(w for f in backend.forwards for c, w in f if c == long.id)
    assert forwarded == 4  # one chunk, once
    with engine.cond:
        assert engine._answer(long, PIECE) == DONE


def test_admission_by_rows_and_kv_bytes_waits_for_room_and_refuses_what_never_fits(backend):
    engine, _ = _engine(backend, max_rows=3, max_kv=1000, token_bytes=10)
    log = []
    with pytest.raises(ValueError, match="max_rows=3"):
        engine.submit(_call("wide", 1, 1, log), rows=4)
    with pytest.raises(ValueError, match="max_kv=1000"):
        engine.submit(_call("long", 1, 1, log), rows=1, tokens=101)
    first = engine.submit(_call("a", 1, 1, log), rows=2, tokens=10)
    second = engine.submit(_call("b", 1, 1, log), rows=1, tokens=90)  # rows fit, KV bytes do not
    third = engine.submit(_call("c", 1, 1, log), rows=1, tokens=10)  # waits behind b: oldest first
    for call in (first, second, third):
        engine.ask(call, ALL)
    engine.step()
    assert list(engine.table.calls) == [first.id] and engine.table.kv == 200
    while not first.done:
        engine.step()
    assert not engine.table.calls and len(engine.table.waiting) == 2
    engine.step()  # admitted at the next step, both: 900 + 100 bytes
    assert second.id in engine.table.calls and third.id in engine.table.calls
    while engine.table.calls:
        engine.step()
    assert second.done and third.done and engine.table.rows == engine.table.kv == 0


def test_a_failed_merged_forward_fails_only_its_call(backend):
    engine, left = _engine(backend)
    log = []
    bad = engine.submit(_call("bad", 2, 4, log, bad_at=1), rows=1)
    good = engine.submit(_call("good", 2, 4, log), rows=1)
    for call in (bad, good):
        engine.ask(call, ALL)
    for _ in range(3):
        engine.step()
    # The merged forward failed, so each request ran again alone: only bad's failed.
    assert backend.forwards[-3:] == [[(bad.id, 1), (good.id, 1)], [(bad.id, 1)], [(good.id, 1)]]
    engine.step()  # the error is raised where bad forwarded: its coroutine ends with it
    assert bad.done and isinstance(bad.error, RuntimeError) and "bad" in log
    with pytest.raises(RuntimeError, match="bad request"):
        with engine.cond:
            engine._answer(bad, PIECE)
    while not good.done:
        engine.step()
    assert good.error is None and left == [bad.id, good.id]


def test_a_consumer_drives_its_call_alone_on_its_own_thread(backend):
    engine, _ = _engine(backend)
    log = []
    call = engine.submit(_call("solo", 3, 2, log), rows=1)
    assert engine.next(call, READY) == READY and call.demand is None
    assert [engine.next(call) for _ in range(3)] == [["solo0"], ["solo1"], ["solo-end"]]
    assert engine.next(call) == DONE and engine.thread is None  # no engine thread was needed


class _Sum(Work):
    """Host work whose items of one kind run as one batch: each gets its value doubled."""

    batches = []

    def __init__(self, kind, value):
        self.kind, self.value = kind, value

    @property
    def key(self):
        return self.kind

    @staticmethod
    def run_all(items):
        _Sum.batches.append([i.value for i in items])
        if any(i.value < 0 for i in items):
            raise ValueError("negative")
        return [2 * i.value for i in items]


def _working(kind, values, got):
    """A call's coroutine: per step, host work on one value, then a piece and a one-token forward."""
    _, cache = yield Request(torch.zeros((1, 2), dtype=torch.long), None, None)
    yield READY
    for v in values:
        got.append((yield _Sum(kind, v)))
        yield [str(v)]
        _, cache = yield Request(torch.zeros((1, 1), dtype=torch.long), None, cache)


def test_the_host_work_of_every_call_runs_as_one_batch_per_key_and_step(backend):
    engine, _ = _engine(backend)
    _Sum.batches = []
    got = {name: [] for name in "abc"}
    calls = [engine.submit(_working(kind, values, got[name]), rows=1)
             for name, kind, values in (("a", "x", [1, 2]), ("b", "x", [10, 20]), ("c", "y", [5, 6]))]
    for call in calls:
        engine.ask(call, ALL)
    while any(not c.done for c in calls):
        engine.step()
    # One batch per kind and step, each item answered with its own result.
    assert sorted(_Sum.batches) == sorted([[1, 10], [5], [2, 20], [6]])
    assert got == {"a": [2, 4], "b": [20, 40], "c": [10, 12]}
    assert all(c.error is None for c in calls)


def test_host_work_that_fails_in_a_batch_fails_only_its_own_call(backend):
    engine, _ = _engine(backend)
    _Sum.batches = []
    got = {"a": [], "b": []}
    a = engine.submit(_working("x", [1, -1], got["a"]), rows=1)
    b = engine.submit(_working("x", [3, 4], got["b"]), rows=1)
    for call in (a, b):
        engine.ask(call, ALL)
    while not (a.done and b.done):
        engine.step()
    assert isinstance(a.error, ValueError) and b.error is None
    assert got == {"a": [2], "b": [6, 8]}
    assert [-1, 4] in _Sum.batches and [-1] in _Sum.batches and [4] in _Sum.batches  # together, then alone


def _answered_into_work(kind, values, got, turns, bad_at=None):
    """A call's coroutine whose forwards make its next host work from their answer (``Request.then``):
    per value, the work's result comes back where the forward was asked for. ``turns`` counts the
    times its loop runs."""
    _, cache = yield Request(torch.zeros((1, 2), dtype=torch.long), None, None)
    yield READY
    turns.append("ready")
    result = yield _Sum(kind, values[0])
    for i, v in enumerate(values[1:], 1):
        got.append(result)

        def then(logits, cache, v=v, i=i):
            if i == bad_at:
                raise KeyError("no work")
            assert logits.shape == (1, 1, 4)  # the answer, as the request asked for it
            return _Sum(kind, v)

        result = yield Request(torch.zeros((1, 1), dtype=torch.long), None, cache, then=then)
        turns.append(i)
    got.append(result)


def test_a_forward_whose_answer_makes_the_next_work_sends_that_work_s_result_in_one_turn(backend):
    engine, _ = _engine(backend)
    _Sum.batches = []
    got, turns = {"a": [], "b": []}, {"a": [], "b": []}
    a = engine.submit(_answered_into_work("x", [1, 2, 3], got["a"], turns["a"]), rows=1)
    b = engine.submit(_working("x", [10, 20, 30], got["b"]), rows=1)
    for call in (a, b):
        engine.ask(call, ALL)
    while not (a.done and b.done):
        engine.step()
    assert got == {"a": [2, 4, 6], "b": [20, 40, 60]}
    assert turns["a"] == ["ready", 1, 2]  # one turn of its loop per forward: the answer alone takes none
    assert [1, 10] in _Sum.batches and [2, 20] in _Sum.batches and [3, 30] in _Sum.batches  # with b's work


def test_an_answer_that_fails_to_make_the_next_work_fails_only_its_call_where_it_waits(backend):
    engine, _ = _engine(backend)
    _Sum.batches = []
    got, turns = {"a": [], "b": []}, []
    a = engine.submit(_answered_into_work("x", [1, 2, 3], got["a"], turns, bad_at=2), rows=1)
    b = engine.submit(_working("x", [10, 20, 30], got["b"]), rows=1)
    for call in (a, b):
        engine.ask(call, ALL)
    while not (a.done and b.done):
        engine.step()
    assert isinstance(a.error, KeyError) and b.error is None
    assert got == {"a": [2, 4], "b": [20, 40, 60]} and turns == ["ready", 1]


def test_streams_whose_consumers_ask_again_at_once_forward_together_every_step(backend):
    """A consumer handed a piece that asks for the next one while the step waits for it has its
    call join that same step's forward: each token takes one step, for every stream."""
    engine, _ = _engine(backend)
    calls = [engine.submit(_working("x", [1, 2, 3], []), rows=1) for _ in "abc"]
    for call in calls:
        engine.ask(call, PIECE)

    def consumers_take_and_ask(own=None):  # what the step waits for: each consumer takes its piece, asks again
        for call in calls:
            if call.events:
                call.events.popleft()
                engine._ask(call, PIECE)

    engine._linger = consumers_take_and_ask
    engine._step(linger=True)  # the prefills
    steps = 0
    while not all(c.done for c in calls):
        engine._step(linger=True)
        steps += 1
    decodes = [f for f in backend.forwards if all(width == 1 for _, width in f)]
    assert decodes == [[(c.id, 1) for c in calls]] * 3  # every call in every decode forward
    assert steps == 4  # 3 tokens (host work, a piece and a forward each), then the calls' ends


def test_a_thread_that_drives_its_own_stream_is_never_waited_for(backend, monkeypatch):
    """The step waits for consumers to ask again, but not for the one whose thread drives it:
    that consumer asks only once the step is over (with a 30 s grace, waiting would show)."""
    monkeypatch.setattr(engine_module, "GRACE", 30.0)
    engine, _ = _engine(backend)
    call = engine.submit(_working("x", [1, 2, 3], []), rows=1)
    pieces = []
    consumer = threading.Thread(target=lambda: pieces.extend(iter(lambda: engine.next(call, PIECE), DONE)))
    consumer.start()
    consumer.join(timeout=10)
    assert not consumer.is_alive() and pieces == [["1"], ["2"], ["3"]]


class _Schedules(RuleBasedStateMachine):
    """Any schedule of submits, consumers taking pieces or the whole answer, cancels and steps, on an
    engine with room for few rows and a short prefill chunk: every call ends, hands its pieces in
    order, forwards its prompt once (in chunks) and each token once, and leaves nothing behind."""

    def __init__(self):
        super().__init__()
        self.backend = _Backend()
        self.engine, self.left = _engine(self.backend, prefill_chunk=4, max_rows=3)
        self.calls = []  # (call, name, prompt, steps, the step whose forward fails or None)
        self.seen = {}  # name -> pieces its consumer took
        self.log = []

    @rule(prompt=st.integers(1, 10), steps=st.integers(0, 3), rows=st.integers(1, 2), whole=st.booleans(),
          bad=st.booleans())
    def submit(self, prompt, steps, rows, whole, bad):
        name = f"c{len(self.calls)}"
        bad_at = steps - 1 if bad and steps else None  # its last token's forward fails
        call = self.engine.submit(_call(name, prompt, steps, self.log, bad_at), rows=rows)
        self.engine.ask(call, ALL if whole else PIECE)
        self.calls.append((call, name, prompt, steps, bad_at))
        self.seen[name] = []

    @rule(data=st.data())
    def take(self, data):
        waiting = [(c, name) for c, name, *_ in self.calls if c.demand != ALL and c.events]
        if waiting:
            call, name = data.draw(st.sampled_from(waiting))
            self.seen[name].append(_take(call)[0])
            self.engine.ask(call, PIECE)

    @rule(data=st.data())
    def cancel(self, data):
        running = [c for c, *_ in self.calls if not c.done]
        if running:
            self.engine.cancel(data.draw(st.sampled_from(running)))

    @rule()
    def step(self):
        gone = {c.id for c, *_ in self.calls if c.done or c.cancelled}
        before = len(self.backend.forwards)
        self.engine.step()
        # A call cancelled before the step leaves at it, unforwarded; an ended one is never forwarded.
        assert not gone & {call_id for f in self.backend.forwards[before:] for call_id, _ in f}
        assert all(c.done for c, *_ in self.calls if c.id in gone)

    @invariant()
    def the_table_counts_its_calls_and_a_piece_held_parks_its_call(self):
        table = self.engine.table
        assert table.rows == sum(c.rows for c in table.calls.values()) <= 3
        assert all(not c.done for c in table.calls.values()) and len(set(self.left)) == len(self.left)
        for call in table.calls.values():  # a consumer holding a piece parks its call: nothing of it runs
            assert len(call.events) <= 1 and not (call.events and (call.request or call.work or call.demand))

    def teardown(self):
        for call, *_ in self.calls:
            if not call.done:
                call.events.clear()
                self.engine.ask(call, ALL)
        for _ in range(200):
            if all(c.done for c, *_ in self.calls):
                break
            self.engine.step()
        table = self.engine.table
        assert not table.calls and not table.waiting and table.rows == table.kv == 0
        widths = {}
        for forward in (f for i, f in enumerate(self.backend.forwards) if i not in self.backend.failed):
            for call_id, width in forward:
                widths.setdefault(call_id, []).append(width)
        for call, name, prompt, steps, bad_at in self.calls:
            assert call.done
            pieces = self.seen[name]
            assert pieces == ([f"{name}{i}" for i in range(steps)] + [f"{name}-end"])[: len(pieces)]
            forwarded = widths.get(call.id, [])
            if call.error is not None:  # its own bad forward, tried with the others, then alone
                assert bad_at is not None and isinstance(call.error, RuntimeError)
            elif not call.cancelled:  # its prompt once, in chunks, then one forward per token
                assert bad_at is None and sum(forwarded) == prompt + steps
            else:  # what it forwarded before it left, never more
                assert sum(forwarded) <= prompt + steps
        assert sorted(self.left) == sorted(call.id for call, *_ in self.calls)  # each call's end told once


test_any_schedule_of_calls_ends_every_call_with_its_own_forwards_and_leaves_nothing = _Schedules.TestCase
_Schedules.TestCase.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)


class _Ask(Work):
    """A call's ask to be stepped with the calls that ask with it (a table of them)."""

    def __init__(self, name):
        self.name = name

    @property
    def key(self):
        return "ask"

    @staticmethod
    def run_all(items):
        return ["alone"] * len(items)  # not seated: each steps on its own

    @staticmethod
    def tables(items):
        return [(list(range(len(items))), lambda seats: _host([item.name for item in items], seats))]


def _guest(name, log):
    """A call that asks to be seated: its prefill, READY, then what its host let it go with."""
    try:
        yield Request(torch.zeros((1, 2), dtype=torch.long), None, None)
        yield READY
        got = yield _Ask(name)
        log.append((name, got))
    finally:
        log.append(name)


def _host(names, seats, fail_at=None):
    """Steps its guests' rows: one forward a step; guest ``i`` leaves after step ``i`` (a gone one is skipped)."""
    cache = None
    for i, (name, seat) in enumerate(zip(names, seats)):
        token = -1 if i == fail_at else 0
        try:
            _, cache = yield Request(torch.full((len(names), 1), token), None, cache)
        except RuntimeError as exc:
            for other in seats[i:]:
                if not other.gone:
                    other.let_go(error=exc)
            raise
        if not seat.gone:
            seat.let_go(f"{name} left at {i}")


def test_calls_seated_together_step_as_one_call_and_leave_one_by_one(backend):
    engine, left = _engine(backend, stats=Stats())
    log = []
    calls = [engine.submit(_guest(name, log), rows=1, tokens=4) for name in "abc"]
    for call in calls:
        engine.ask(call, ALL)
    engine.step()  # their prefills, merged
    rows = engine.table.rows
    engine.step()  # READY, their asks: seated; the host's first forward
    (host,) = [c for c in engine.table.calls.values() if c.guests]
    assert [c.seat for c in calls] == [host] * 3 and host.guests == calls
    assert backend.forwards[-1] == [(host.id, 1)]
    assert engine.running() == 1 and engine.stats.calls_running == 3  # the host is no caller's
    assert engine.table.rows == rows  # the host holds its guests' rows
    assert not log
    engine.step()  # the host's first step answered: a leaves, and ends at this step
    assert calls[0].done and log == [("a", "a left at 0"), "a"] and not calls[1].done
    engine.cancel(calls[1])
    engine.step()  # b is closed where it waits; the host skips it
    assert calls[1].done and calls[1].error is None and log[-1] == "b"
    engine.step()
    assert calls[2].done and log[-2:] == [("c", "c left at 2"), "c"]
    assert host.done and not engine.table.calls and engine.table.rows == engine.table.kv == 0
    assert engine.running() == 0 and engine.stats.calls_running == 0
    assert sorted(left) == sorted([c.id for c in calls] + [host.id])


def test_a_failing_host_fails_the_calls_still_seated_and_a_failed_seating_leaves_them_alone(backend, monkeypatch):
    engine, _ = _engine(backend)
    log = []
    monkeypatch.setattr(_Ask, "tables", staticmethod(
        lambda items: [(list(range(len(items))), lambda seats: _host([i.name for i in items], seats, fail_at=1))]))
    calls = [engine.submit(_guest(name, log), rows=1) for name in "abc"]
    for call in calls:
        engine.ask(call, ALL)
    for _ in range(4):
        engine.step()
    assert calls[0].done and calls[0].error is None
    assert all(isinstance(c.error, RuntimeError) for c in calls[1:]) and not engine.table.calls

    def broken(items):
        def make(seats):
            raise MemoryError("no room to stack them")
        return [(list(range(len(items))), make)]

    monkeypatch.setattr(_Ask, "tables", staticmethod(broken))
    log.clear()
    calls = [engine.submit(_guest(name, log), rows=1) for name in "de"]
    for call in calls:
        engine.ask(call, ALL)
    for _ in range(3):
        engine.step()
    assert all(c.done and c.error is None for c in calls) and ("d", "alone") in log and ("e", "alone") in log
