"""Calls that start together, stepped as one: their rows in one batch, one grid, one advance.

Concurrent calls on one model share each step's draw and forward (the engine merges
them), but each still takes its own turn of the decoding loop at every step: its draw,
its advance, its grid, its forward's request. Calls that reach their first step together
with the same generator and options (a burst of requests, an ``asyncio.gather`` of
prompts) are instead *seated* at one table: one decoding of all their rows
(:meth:`~continuous.decode.loop.Decoding.joined`), their batches side by side and their
caches stacked, so that a step is one turn for all of them, as for one call holding all
their prompts. Each call keeps its span of the table's rows:

- it *leaves* once its rows are all finished: its rows of the batch (their slots, cache,
  logits, weights and texts) are taken (:meth:`Joined.take`), and the call ends with
  them, as if it had run alone;
- a call cancelled or closed meanwhile ends at once with its rows so far; they are then
  finished in the table, and never read again;
- the rows of calls that left stay in the batch, as a call's finished rows do, and their
  memory with them, until the table ends.

A failure of the table's step (its forward, a matcher) fails every call still seated.
Only calls whose consumers take the whole answer are seated: a stream's consumer reads
each piece, and parks its call while it holds one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..kv import Slots
from .finish import Finish
from .grid import Frozen

__all__ = ["Joined", "LEFT"]


class _Left:
    def __repr__(self) -> str:
        return "LEFT"


#: What a seated call's coroutine is sent once its rows are done (:attr:`Decoding.taken` holds them).
LEFT = _Left()


@dataclass(eq=False)
class _Guest:
    """A call seated at the table: its decoding, what the engine knows of it, its rows of the
    table and the table's slots its input holds (the first ``width0``)."""

    decoding: Any
    seat: Any
    rows: slice
    width0: int


class Joined:
    """The table of some calls' rows: one decoding that steps them all (see the module).

    Parameters
    ----------
    decodings
        The calls' :class:`~continuous.decode.loop.Decoding`, each at its first step, of one
        :attr:`~continuous.decode.loop.Decoding.seat_key`.
    seats
        For each, what the engine knows of its call (:class:`~continuous.models.engine.Seat`):
        whether it is gone, and how to let it go on.
    """

    def __init__(self, decodings: list, seats: list):
        self.decoding = type(decodings[0]).joined(decodings)
        self.guests, at = [], 0
        for d, seat in zip(decodings, seats):
            n = len(d.batch.states)
            self.guests.append(_Guest(d, seat, slice(at, at + n), d.grid.width0))
            at += n
            # Its rows are the table's now: its own batch is let go, and the cache it stacked with it
            # (its loop, waiting at its first step, still holds the batch).
            d.batch.cache = None
            d.table, d.batch = self, None
        self.seated = list(self.guests)  # those still seated
        self._finished = -1  # the table's finished rows at the last departures
        self.decoding.on_step = self._departures

    @classmethod
    def steps_of(cls, decodings: list, seats: list):
        """The table's coroutine (what the engine steps for the seated calls)."""
        return cls(decodings, seats).steps()

    def steps(self):
        """Step the table's rows until every row finished, letting each call go as its rows end."""
        try:
            yield from self.decoding.decode()
            for guest in self.seated:  # rows done before any step's departures (none are, in practice)
                self._release(guest)
        except GeneratorExit:
            raise
        except BaseException as exc:
            for guest in self.seated:
                guest.decoding.table = None
                guest.seat.let_go(error=exc)
            raise
        finally:
            # No reference cycle outlives the table: its memory goes as soon as nothing holds it.
            self.decoding.on_step, self.guests, self.seated = None, [], []

    def _departures(self) -> list[int]:
        """After a step's advance: the calls whose rows all finished leave; the rows of a call
        that is gone are finished (nobody reads them). Returns the rows of the calls that left."""
        states, rows = self.decoding.batch.states, []
        finished = sum(row.finished for row in states)
        if finished == self._finished and not any(guest.seat.gone for guest in self.seated):
            return rows  # most steps: no row finished, nobody left
        self._finished = finished
        still = []
        for guest in self.seated:
            if guest.seat.gone:  # its rows as they are are its result (it may not have ended yet)
                if guest.decoding.table is not None:
                    self._hand_over(guest)
                for row in states[guest.rows]:
                    if not row.finished:
                        row.finish(Finish.LENGTH)
            elif all(row.finished for row in states[guest.rows]):
                self._release(guest)
            else:
                still.append(guest)
                continue
            rows += range(guest.rows.start, guest.rows.stop)
        self.seated = still
        return rows

    def _release(self, guest: _Guest) -> None:
        # Its rows are finished: the table changes them no more (but for the text streamed, which
        # a result does not read), so they are handed over as they are, not copied.
        self._hand_over(guest, copy=False)
        guest.seat.let_go(LEFT)

    def hand_over(self, decoding) -> None:
        """A seated call leaves now (it was closed): its rows so far become its own (:meth:`take`)."""
        self._hand_over(self._guest(decoding))

    def _hand_over(self, guest: _Guest, copy: bool = True) -> None:
        guest.decoding.taken, guest.decoding.table = self._take(guest, copy), None

    def take(self, decoding) -> tuple:
        """A seated call's rows as its own :meth:`~continuous.decode.loop.Decoding.seen` reads
        them: copies of their states, their slots, cache, logits, weights, completeness and
        constraint cost. Their slots are those the call alone would have: its input's, then the
        generated columns where one of its rows holds a token (a step as wide as the table's
        widest row leaves the others' holes the call alone would not have, and the slots its
        rewinds took back are left out too)."""
        return self._take(self._guest(decoding), True)

    def _guest(self, decoding) -> _Guest:
        return next(g for g in self.guests if g.decoding is decoding)

    def _take(self, guest: _Guest, copy: bool) -> tuple:
        """:meth:`take`, the states copied only with ``copy``."""
        table, rows = self.decoding, guest.rows
        batch, grid = table.batch, table.grid
        states = [row.copy() for row in batch.states[rows]] if copy else batch.states[rows]
        for row in states:
            row.flush()
        ok = batch.logits_ok[rows]
        if table.unforwarded is not None:
            ok = [ok and not c for ok, c in zip(ok, table.unforwarded[rows])]
        reals = [real[rows] for real in grid.reals]
        kept = [j for j, real in enumerate(reals) if any(real)]
        frozen = Frozen(grid.token_ids[rows, : guest.width0], grid.real[rows, : guest.width0],
                        [grid.columns[j][rows] for j in kept], [reals[j] for j in kept])
        cost = batch.cost_so_far()
        return (states, frozen, self._cache(guest, kept), batch.logits[rows], ok, batch.constraints.complete_rows(rows),
                batch.weights[rows], lambda: cost()[rows])

    def _cache(self, guest: _Guest, kept: list[int]):
        """The guest's rows of the table's cache: its input's slots, then those of the generated
        columns ``kept`` that were forwarded."""
        cache, width0 = self.decoding.batch.cache, self.decoding.grid.width0
        if cache is None:
            return None
        forwarded = [width0 + j for j in kept if width0 + j < cache.length]
        if len(forwarded) == cache.length - width0:  # every forwarded column: runs of slots
            slots = Slots(None, range(cache.length)) if guest.width0 == width0 else Slots(
                range(guest.width0), range(width0, cache.length))
        else:
            slots = Slots(torch.tensor(list(range(guest.width0)) + forwarded, dtype=torch.long))
        return cache.part(guest.rows, slots)
