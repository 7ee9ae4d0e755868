"""The stacked cache of the calls that a round merges, kept from round to round while they stay.

A merged forward needs the calls' caches side by side. Copying every call's cache into
one at every round would cost as much memory traffic as attention itself; so the stacked
cache of the last round is kept, with, for each call, where its slots sit in it. When
the next round merges the same calls, each continuing the cache it got back, the new
slots are appended to the stacked cache and nothing is copied: each call holds its rows
of it (:class:`~continuous.kv.JointRows`), copied out only when read. Any other round (a
call joined or left, a cache was replaced) stacks the caches again.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from ..kv import JointRows, KVCache, stack
from .scheduler import Request

__all__ = ["Joint", "Layout"]


@dataclass
class Layout:
    """A round's stacked rows: the requests in row order, their cache, and per request the
    stacked slot of each of its cached slots; ``start`` is the stacked cache's length."""

    requests: list[Request]
    cache: KVCache | None
    slots: list[torch.Tensor]
    start: int


class Joint:
    """The stacked cache of the last merged round, and each call's place in it."""

    def __init__(self):
        self.cache: KVCache | None = None
        # id of the rows a call got back -> (those rows, weakly, their first row, their slots' places)
        self.members: dict[int, tuple[weakref.ref, int, torch.Tensor]] = {}

    def layout(self, requests: list[Request]) -> Layout:
        """The stacked rows of ``requests``: the kept ones when they continue the last round."""
        kept = [self.members.get(id(r.cache)) for r in requests]
        if self.cache is not None and len(kept) == len(self.members) and all(
                m is not None and m[0]() is r.cache for m, r in zip(kept, requests)):
            order = sorted(range(len(requests)), key=lambda i: kept[i][1])
            return Layout([requests[i] for i in order], self.cache, [kept[i][2] for i in order], self.cache.length)
        self._settle({id(r.cache) for r in requests})
        lengths = [r.cache.length if r.cache is not None else 0 for r in requests]
        cache = stack([r.cache for r in requests], [r.rows for r in requests], max(r.width for r in requests))
        return Layout(requests, cache, [torch.arange(n) for n in lengths], max(lengths))

    def keep(self, layout: Layout, cache: KVCache, returned: list[JointRows]) -> None:
        """After the round: ``cache`` is the stacked cache, ``returned`` the calls' rows of it.

        A stacked cache whose holes outgrow its rows' slots is not kept (the next round
        stacks the caches again, without them).
        """
        members, at = {}, 0
        for r, own in zip(layout.requests, returned):
            members[id(own)] = (weakref.ref(own), at, own._slots)
            at += r.rows
        longest = max(own.length for own in returned)
        self.cache, self.members = (cache, members) if cache.length <= 2 * longest + 64 else (None, {})

    def _settle(self, going_on: set[int]) -> None:
        """Forget the last round's stacked cache; the rows of it that a call which left still
        holds (its final state) are copied out, so that the stacked buffer is freed."""
        for key, (ref, _, _) in self.members.items():
            own = ref()
            if own is not None and key not in going_on:
                own.settle()
        self.cache, self.members = None, {}  # freed before the copy
