"""The engine's table: the calls it holds, by explicit id, each with its rows and KV bytes.

A call is a coroutine (:meth:`continuous.decode.Decoding.run`) plus what the engine
knows of it: what its consumer asked for (``demand``), the events it handed and not yet
taken, its pending forward and the reply to it, and whether it was cancelled. Admission
counts the rows and the KV bytes the admitted calls reserve; a call past a limit waits,
in order of arrival, for room. A call may be *seated* in another (:meth:`Table.seat`):
that call steps the rows of its ``guests`` as its own until it lets each go on.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Generator

from .scheduler import Request, Work

__all__ = ["Call", "Table", "PIECE", "ALL", "READY"]

#: What a consumer asks of its call: the next piece; everything (pieces are dropped); or
#: the call prepared (its prefill done), before its first step.
PIECE, ALL, READY = "piece", "all", "ready"


@dataclass(eq=False)
class Call:
    """One call in the engine's table."""

    id: int
    steps: Generator
    rows: int  # rows its forwards hold
    kv: int  # KV bytes it reserves
    demand: str | None = None  # PIECE, ALL, READY, or None: parked (its consumer holds a piece)
    events: deque = field(default_factory=deque)  # pieces handed and not yet taken
    request: Request | None = None  # its forward, waiting for a step
    work: Work | None = None  # its host work (a step's sampling), waiting to run with other calls'
    start: int | None = None  # where its pending forward started (a chunked prefill's cache grows)
    reply: tuple | None = None  # (result, error) of its last forward, sent when it is advanced
    then: Callable | None = None  # what makes its next work of that result, with no turn of its loop (Request.then)
    admitted: bool = False
    ready: bool = False
    cancelled: bool = False
    done: bool = False
    error: BaseException | None = None
    handed_at: float = 0.0  # when it last handed a piece to its consumer
    first_piece_at: float | None = None  # time.monotonic() of its first piece, taken or not
    wakers: list = field(default_factory=list)  # (event loop, future) of async consumers waiting
    seat: "Call | None" = None  # the call that steps its rows with others' (see Table.seat), until it lets go
    guests: list = field(default_factory=list)  # the calls whose rows this call steps

    @property
    def asks(self) -> bool:
        """Its consumer asked for something and nothing of it is pending: a step advances it."""
        return (self.seat is None and not self.done and not self.cancelled and self.request is None
                and self.work is None and self.demand is not None)


class Table:
    """The calls admitted (``calls``, by id) and those waiting for room (``waiting``, oldest first)."""

    def __init__(self, max_rows: int | None = None, max_kv: int | None = None):
        self.max_rows, self.max_kv = max_rows, max_kv
        self.calls: dict[int, Call] = {}
        self.waiting: deque[Call] = deque()
        self.rows = 0
        self.kv = 0
        self.stepping = 0  # admitted calls that step on their own (not seated in another)
        self.hosts = 0  # admitted calls that step others' rows (see seat)
        self._ids = itertools.count(1)

    def check(self, rows: int, kv: int) -> None:
        """Refuse a call that could never be admitted, saying which limit it exceeds."""
        if self.max_rows is not None and rows > self.max_rows:
            raise ValueError(f"this call needs {rows} rows (prompts x samples) and the model admits "
                             f"max_rows={self.max_rows}: ask for fewer, or raise max_rows")
        if self.max_kv is not None and kv > self.max_kv:
            raise ValueError(f"this call may need {kv} bytes of KV cache (its rows x its prompt and max_tokens) "
                             f"and the model admits max_kv={self.max_kv}: lower max_tokens, or raise max_kv")

    def add(self, steps: Generator, rows: int, kv: int) -> Call:
        """A new call, waiting for admission."""
        self.check(rows, kv)
        call = Call(next(self._ids), steps, rows, kv)
        self.waiting.append(call)
        return call

    def fits(self, call: Call) -> bool:
        return ((self.max_rows is None or self.rows + call.rows <= self.max_rows)
                and (self.max_kv is None or self.kv + call.kv <= self.max_kv))

    def admit(self) -> list[Call]:
        """Admit the waiting calls, oldest first, while they fit (a cancelled one leaves the queue)."""
        admitted = []
        while self.waiting and (self.waiting[0].cancelled or self.fits(self.waiting[0])):
            call = self.waiting.popleft()
            call.admitted = True
            self.calls[call.id] = call
            self.rows, self.kv = self.rows + call.rows, self.kv + call.kv
            self.stepping += 1
            admitted.append(call)
        return admitted

    def seat(self, steps: Generator, guests: list[Call]) -> Call:
        """A call that steps the rows of ``guests`` (admitted calls) as its own: it takes over their
        rows and KV bytes, which it holds until it ends (a guest's rows stay in its batch once the
        guest ended); it runs whole, its consumer being its guests."""
        host = Call(next(self._ids), steps, sum(g.rows for g in guests), sum(g.kv for g in guests), demand=ALL,
                    admitted=True, ready=True, guests=list(guests))
        for guest in guests:
            guest.seat, guest.rows, guest.kv = host, 0, 0
        self.calls[host.id] = host
        self.stepping += 1 - len(guests)
        self.hosts += 1
        return host

    def let_go(self, guest: Call) -> None:
        """``guest`` steps on its own again (its host is done with its rows)."""
        guest.seat = None
        self.stepping += 1

    def remove(self, call: Call) -> None:
        """The call ended: its rows and KV bytes are free."""
        if self.calls.pop(call.id, None) is not None:
            self.rows, self.kv = self.rows - call.rows, self.kv - call.kv
            self.stepping -= call.seat is None
            self.hosts -= bool(call.guests)
        elif call in self.waiting:
            self.waiting.remove(call)
