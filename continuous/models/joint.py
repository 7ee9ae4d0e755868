"""The stacked cache of the calls that an engine step merges, kept from step to step while they stay.

A merged forward needs the calls' caches side by side. Copying every call's cache into
one at every step would cost as much memory traffic as attention itself; so the stacked
cache of the last step is kept, with, for each call (by its engine call id), the rows it
was handed and where their slots sit. When the next step merges the same calls, each
continuing the very rows it was handed, the new slots are appended to the stacked cache
and nothing is copied: each call holds its rows of it (:class:`~continuous.kv.JointRows`),
copied out only when read. Any other step (a call joined or left, a cache was replaced,
a request of no call, holes past the share a state squeezes out of its own cache: see
:func:`~continuous.layout.dense`) stacks the caches again.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from ..kv import JointRows, KVCache, Slots, stack
from ..layout import dense
from ..transfer import split_rows
from .scheduler import Request

__all__ = ["Joint", "Layout", "bucket"]


def bucket(rows: int) -> int:
    """The rows a stacked cache of ``rows`` live rows gets with buckets: 1, 2, 4, 8, then multiples of 8."""
    return 1 << (rows - 1).bit_length() if rows <= 8 else -(-rows // 8) * 8


@dataclass(kw_only=True)
class Layout:
    """A step's stacked rows: the requests in row order, their cache, and per request the
    stacked slot of each of its cached slots and its first row; ``start`` is the stacked
    cache's length and ``rows`` its rows, among them the rows of calls that left (``dead``:
    ``(first, stop)`` runs, forwarded with the others and never read).
    ``kept`` says that the step continues the last one, whose stacked attention mask of the
    cached slots is ``mask`` (``None``: every slot real); else the mask is made again from
    the requests' own. ``runs`` (made once, and kept by the steps that continue it) is how
    the rows split: per run of rows its size, each request's run, and the dead runs."""

    requests: list[Request]
    cache: KVCache | None
    slots: list[Slots]
    start: int
    at: list[int]
    rows: int
    kept: bool = False
    mask: torch.Tensor | None = None
    runs: tuple[list[int], list[int], list[tuple[int, int]]] | None = None

    def split(self) -> tuple[list[int], list[int], list[tuple[int, int]]]:
        """``runs``, made if not yet."""
        if self.runs is None:
            sizes, run_of, dead, row = [], [], [], 0
            for r, at in zip(self.requests, self.at):
                if at > row:
                    dead.append((row, at))
                    sizes.append(at - row)
                run_of.append(len(sizes))
                sizes.append(r.batch_rows)
                row = at + r.batch_rows
            if row < self.rows:
                dead.append((row, self.rows))
                sizes.append(self.rows - row)
            self.runs = (sizes, run_of, dead)
        return self.runs

    def blocks(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Each request's rows of ``t`` (``[rows, ...]``, in stacked order), as views made at once;
        with no dead rows, :func:`~continuous.transfer.split_rows`' blocks (a shared draw of them, in
        order, joins them back with no copy)."""
        sizes, run_of, dead = self.split()
        if not dead:
            return list(split_rows(t, sizes))
        parts = t.split(sizes)
        return [parts[i] for i in run_of]

    @property
    def dead(self) -> list[tuple[int, int]]:
        return self.split()[2]


class Joint:
    """The stacked cache of the last merged step, and each call's place in it.

    A call that leaves leaves its rows behind, as one call's finished rows stay in its
    batch: the others go on in the same stacked cache, with nothing copied, until the rows
    of calls that left outnumber theirs (or a call joins) and the caches are stacked again.
    A few more rows cost little on a device bound by reading the weights.

    ``compiled`` says that merged steps run compiled. A compiled step is made for each
    shape it sees, so a stacked cache then has a bucket's number of rows (1, 2, 4, 8, then
    multiples of 8), those past the calls' as rows of no call.
    """

    def __init__(self, *, compiled: bool = False):
        self.compiled = compiled
        self.cache: KVCache | None = None
        self.mask: torch.Tensor | None = None  # the stacked cache's attention mask (None: every slot real)
        self.rows = 0  # the stacked cache's rows, those of calls that left included
        # In row order: each call's engine id, the rows it was handed (weakly) and its first row.
        self.calls: list[int] = []
        self.refs: list[weakref.ref] = []
        self.at: list[int] = []
        self.runs = None  # the last step's Layout.runs (None once a call left)
        self._room: torch.Tensor | None = None  # the mask, then ones: what later steps' masks are views of

    def layout(self, requests: list[Request]) -> Layout:
        """The stacked rows of ``requests``: the kept ones when they continue the last step."""
        layout = self._kept(requests)
        if layout is not None:
            return layout
        # Stacked in the engine's order of calls, which is the order a shared draw hands out their
        # ids: the next steps then forward those ids as they are (the batching policy orders a
        # group by width).
        requests = sorted(requests, key=lambda r: -1 if r.call is None else r.call)
        live = sum(r.batch_rows for r in requests)
        self.forget({id(r.cache) for r in requests})
        lengths = [r.cache.length if r.cache is not None else 0 for r in requests]
        rows = bucket(live) if self.compiled else live
        pad = [None] if rows > live else []  # the bucket's rows past the calls' (all zeros)
        cache = stack([r.cache for r in requests] + pad, [r.batch_rows for r in requests] + [rows - live] * len(pad),
                      max(r.width for r in requests))
        at = [sum(r.batch_rows for r in requests[:i]) for i in range(len(requests))]
        slots_of = {n: Slots(None, range(n)) for n in set(lengths)}  # shared by the calls of one length
        return Layout(requests=requests, cache=cache, slots=[slots_of[n] for n in lengths], start=max(lengths), at=at,
                      rows=rows)

    def _kept(self, requests: list[Request]) -> Layout | None:
        """The last step's layout when ``requests`` continue it: the same calls, each with the
        very rows it was handed, most rows live, and the stacked cache :func:`~continuous.layout.dense` for its
        longest call (a prefill beside decode steps leaves the others' rows holes every later step attends over)."""
        if self.cache is None or len(requests) != len(self.calls):
            return None
        if [r.call for r in requests] != self.calls:  # most steps come in the stacked order already
            place = {call: i for i, call in enumerate(self.calls)}
            requests = sorted(requests, key=lambda r: place.get(r.call, -1))
            if [r.call for r in requests] != self.calls:
                return None
        live, longest = 0, 0
        for r, ref in zip(requests, self.refs):
            if r.cache is None or ref() is not r.cache:
                return None
            live += r.batch_rows
            longest = max(longest, r.cache.length)
        if 2 * live < self.rows or not dense(self.cache.length, longest):
            return None
        return Layout(requests=requests, cache=self.cache, slots=[r.cache.slots for r in requests],
                      start=self.cache.length, at=self.at, rows=self.rows, kept=True, mask=self.mask, runs=self.runs)

    def mask_after(self, mask: torch.Tensor | None, width: int) -> torch.Tensor | None:
        """``mask`` (the kept step's, ``None``: every slot real) followed by ``width`` columns of
        ones, as a view of a tensor with room for more: a step makes no tensor for it."""
        if mask is None:
            return None
        (rows, length), room = mask.shape, self._room
        if (room is None or room.data_ptr() != mask.data_ptr() or room.shape[0] != rows
                or room.shape[1] < length + width):
            room = mask.new_ones((rows, 2 * (length + width)))
            room[:, :length] = mask
            self._room = room
        return room[:, : length + width]

    def keep(self, layout: Layout, cache: KVCache, returned: list[JointRows], mask: torch.Tensor | None) -> None:
        """After the step: ``cache`` is the stacked cache, ``returned`` the calls' rows of it,
        ``mask`` its attention mask (``None``: every slot real).

        Kept only when every request belongs to a call, all different (the next step
        stacks the caches again, without holes, once they are not :func:`~continuous.layout.dense`).
        """
        calls = [r.call for r in layout.requests]
        if None in calls or len(set(calls)) < len(calls):
            self.forget()
            return
        self.cache, self.mask, self.rows, self.runs = cache, mask, layout.rows, layout.split()
        self.calls, self.at, self.refs = calls, layout.at, [weakref.ref(own) for own in returned]

    def leave(self, call: int) -> None:
        """A call ended: the rows it was handed are copied out (its final state owns its cache);
        they stay in the stacked cache as rows of no call, which the others' steps forward and
        never read (the last call to leave drops the stacked cache)."""
        if call not in self.calls:
            return
        i = self.calls.index(call)
        own = self.refs[i]()
        # New lists: a layout made from the old ones may still be read.
        self.calls, self.refs, self.at = (x[:i] + x[i + 1 :] for x in (self.calls, self.refs, self.at))
        self.runs = None  # its rows are dead rows now
        if own is not None:
            own.settle()
        if not self.calls:
            self.forget()

    def forget(self, stacked_again: set[int] = frozenset()) -> None:
        """Drop the last step's stacked cache; the rows of it that a call still holds are copied
        out, so that the stacked buffer is freed (but those about to be stacked again, by the
        ids of the caches: the stack copies them)."""
        refs = self.refs
        self.cache, self.mask, self.rows, self.runs, self._room = None, None, 0, None, None
        self.calls, self.refs, self.at = [], [], []
        for ref in refs:
            if (own := ref()) is not None and id(own) not in stacked_again:
                own.settle()
