"""The batching policy of a model's engine: which forwards run together, and how a long one is cut.

A step of the :class:`~continuous.models.engine.Engine` takes the forwards its calls ask
for (:class:`Request`) and runs:

- the requests up to ``prefill_chunk`` tokens wide, in groups whose padding to a common
  width wastes little (decode steps and short forced runs together, prompts of similar
  lengths together), each group merged into one forward (:func:`split`);
- one chunk of ``prefill_chunk`` tokens of the oldest longer request (a long prompt's
  prefill), so that decoding rows keep moving between its chunks (:meth:`Request.chunk`).
"""

from __future__ import annotations

import time
from dataclasses import KW_ONLY, dataclass, field
from typing import Any, Callable

import torch

__all__ = ["answered", "Request", "Work", "split", "PREFILL_CHUNK", "PREFILL_CHUNK_GPU"]

#: Tokens of a prefill forwarded per step while other calls decode.
PREFILL_CHUNK = 512
#: The same on a GPU, where a forward's fixed cost is launching its kernels: chunks of
#: 512 tokens leave the device idle most of the time (a 15k-token prompt took twice as long).
PREFILL_CHUNK_GPU = 8192


@dataclass(eq=False)
class Request:
    """One call's forward: ``input_ids`` ``[rows, n]`` after ``cache``, as ``Model.forward`` takes it.

    ``call`` is the id of the engine call that asked for it (``None`` for a direct forward).
    ``reserve`` is the length its cache will reach once a longer request it is a chunk of
    is forwarded: the first chunk makes room for all of them, so that none copies the cache.
    ``last`` asks for the logits of the last slot only, ``[rows, vocab]`` (what a decode step
    reads): a merged forward then cuts them out once for all its requests, not once each.
    ``then``, ``then(logits, cache) -> Work``, takes the answer where it comes and returns the
    host work the call asks for next (its next step's draw): whoever runs the request runs
    that work, with the same work of other calls, and sends the call its result instead of
    the answer. A call's step then needs one turn of its loop, not two.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    cache: Any
    _: KW_ONLY
    logits_to_keep: int = 1
    n_real: int | None = None
    holes: bool = True
    call: int | None = None
    arrived: float = field(default_factory=time.monotonic)
    reserve: int = 0
    last: bool = False
    then: Callable[[torch.Tensor, Any], "Work"] | None = None

    def __post_init__(self):
        # Read many times a step by the batching policy and the merged forward: kept, not computed.
        #: The slots this request appends (its ``input_ids``' second dimension).
        self.width: int = self.input_ids.shape[1]
        #: The rows this request forwards (its ``input_ids``' first dimension).
        self.batch_rows: int = self.input_ids.shape[0]

    def chunk(self, size: int) -> "Request | None":
        """The first ``size`` slots as a request of their own (``None`` when the rest is short enough).

        The last chunk keeps at least ``logits_to_keep`` slots, so its logits are the request's.
        """
        if self.width <= max(size, self.logits_to_keep):
            return None
        size = min(size, self.width - self.logits_to_keep)
        start = self.cache.length if self.cache is not None else 0
        mask = None if self.attention_mask is None else self.attention_mask[:, : start + size]
        return Request(self.input_ids[:, :size], mask, self.cache, holes=self.holes, call=self.call,
                       reserve=start + self.width)

    def advance(self, size: int, cache) -> None:
        """The first ``size`` slots were forwarded into ``cache``: the request goes on after them."""
        self.input_ids = self.input_ids[:, size:]
        self.width -= size
        self.cache = cache
        self.n_real = None  # counted again from the mask (or the width) of what is left


def answered(request: Request, logits: torch.Tensor, cache) -> tuple:
    """``(logits, cache)`` as ``request`` asked for them: a backend's ``[rows, keep, vocab]``
    logits, of the last slot only when :attr:`Request.last` (logits cut already pass as they are)."""
    return (logits[:, -1] if request.last and logits.dim() == 3 else logits), cache


class Work:
    """Host work of one call that the engine runs together with the same work of other calls.

    A call's coroutine yields it as it yields a :class:`Request`, and is sent back its
    result. The items of one ``key`` pending at a step run as one:
    ``type(item).run_all(items)`` returns each item's result, in order. A kind of work may
    also say which of its calls can be stepped as one from now on:
    ``type(item).tables(items)`` (optional) returns, per such set, the items' indices and
    ``make(seats)``, the coroutine of the call that steps them (see
    :meth:`~continuous.models.engine.Engine._seat_all`).
    """

    @property
    def key(self):
        return id(self)

    @staticmethod
    def run_all(items: list["Work"]) -> list:
        raise NotImplementedError


def split(batch: list[Request], chunk: int, pads: bool = True) -> tuple[list[list[Request]], list[Request]]:
    """The groups of requests that each run as one padded forward, and the longer requests, oldest first.

    Requests are padded to the widest of their group; a group takes requests from the
    narrowest up while its padded slots stay at most twice its real ones: on a device
    bound by reading the weights, a few more slots are free, many are not (without
    ``pads``, nothing is padded: one group). Requests wider than ``chunk`` (long
    prefills) are cut into chunks, one per step.
    """
    ordered = sorted((r for r in batch if r.width <= chunk), key=lambda r: (r.width, r.arrived))
    groups: list[list[Request]] = []
    group, rows, slots = [], 0, 0
    for r in ordered:
        if pads and group and (rows + r.batch_rows) * r.width > 2 * (slots + r.batch_rows * r.width):
            groups.append(group)
            group, rows, slots = [], 0, 0
        group.append(r)
        rows, slots = rows + r.batch_rows, slots + r.batch_rows * r.width
    if group:
        groups.append(group)
    wide = sorted((r for r in batch if r.width > chunk), key=lambda r: r.arrived)
    return groups, wide
