"""The stacked cache of the calls that an engine step merges, kept from step to step while they stay.

A merged forward needs the calls' caches side by side. Copying every call's cache into
one at every step would cost as much memory traffic as attention itself; so the stacked
cache of the last step is kept, with, for each call (by its engine call id), the rows it
was handed and where their slots sit. When the next step merges the same calls, each
continuing the very rows it was handed, the new slots are appended to the stacked cache
and nothing is copied: each call holds its rows of it (:class:`~continuous.kv.JointRows`),
copied out only when read. Any other step (a call joined or left, a cache was replaced,
a request of no call) stacks the caches again.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from ..kv import JointRows, KVCache, Slots, stack
from .scheduler import Request

__all__ = ["Joint", "Layout"]


@dataclass
class Layout:
    """A step's stacked rows: the requests in row order, their cache, and per request the
    stacked slot of each of its cached slots; ``start`` is the stacked cache's length.
    ``mask`` is the stacked attention mask of the cached slots when the step continues the
    last one (``None``: made again from the requests' own)."""

    requests: list[Request]
    cache: KVCache | None
    slots: list[Slots]
    start: int
    mask: torch.Tensor | None = None


class Joint:
    """The stacked cache of the last merged step, and each call's place in it."""

    def __init__(self):
        self.cache: KVCache | None = None
        self.mask: torch.Tensor | None = None  # the stacked cache's attention mask
        # engine call id -> (the rows it was handed, weakly; their first row)
        self.members: dict[int, tuple[weakref.ref, int]] = {}

    def layout(self, requests: list[Request]) -> Layout:
        """The stacked rows of ``requests``: the kept ones when they continue the last step."""
        kept = [self.members.get(r.call) for r in requests]
        if self.cache is not None and len(kept) == len(self.members) and all(
                m is not None and r.cache is not None and m[0]() is r.cache for m, r in zip(kept, requests)):
            order = sorted(range(len(requests)), key=lambda i: kept[i][1])
            ordered = [requests[i] for i in order]
            return Layout(ordered, self.cache, [r.cache.slots for r in ordered], self.cache.length, self.mask)
        self.forget({id(r.cache) for r in requests})
        lengths = [r.cache.length if r.cache is not None else 0 for r in requests]
        cache = stack([r.cache for r in requests], [r.batch_rows for r in requests], max(r.width for r in requests))
        return Layout(requests, cache, [Slots(None, range(n)) for n in lengths], max(lengths))

    def keep(self, layout: Layout, cache: KVCache, returned: list[JointRows], mask: torch.Tensor) -> None:
        """After the step: ``cache`` is the stacked cache, ``returned`` the calls' rows of it,
        ``mask`` its attention mask.

        Kept only when every request belongs to a call, all different, and while the
        stacked cache's holes do not outgrow its rows' slots (else the next step stacks
        the caches again, without them).
        """
        calls = [r.call for r in layout.requests]
        longest = max(own.length for own in returned)
        if None in calls or len(set(calls)) < len(calls) or cache.length > 2 * longest + 64:
            self.forget()
            return
        members, at = {}, 0
        for r, own in zip(layout.requests, returned):
            members[r.call] = (weakref.ref(own), at)
            at += r.batch_rows
        self.cache, self.members, self.mask = cache, members, mask

    def leave(self, call: int) -> None:
        """A call ended: the rows it was handed are copied out (its final state owns its cache),
        and the stacked cache is dropped (the others' rows copied out too), since it holds rows
        that are no call's."""
        member = self.members.pop(call, None)
        if member is not None and (own := member[0]()) is not None:
            own.settle()
        if member is not None:
            # Its rows stay in the stacked cache: the next step stacks the others again.
            self.forget()

    def forget(self, stacked_again: set[int] = frozenset()) -> None:
        """Drop the last step's stacked cache; the rows of it that a call still holds are copied
        out, so that the stacked buffer is freed (but those about to be stacked again, by the
        ids of the caches: the stack copies them)."""
        members, self.cache, self.members, self.mask = self.members, None, {}, None
        for ref, _ in members.values():
            if (own := ref()) is not None and id(own) not in stacked_again:
                own.settle()
