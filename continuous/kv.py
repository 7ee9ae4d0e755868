"""The local KV cache as a value.

A :class:`KVCache` is a view ``(buffer, length)`` on a preallocated buffer shared by
every state that grew from the same computation. Slots ``[0, length)`` of a buffer are
never written again once filled, so a shorter view (a cropped state, an older state)
stays valid when a longer one appends. A view appends in place only when it is the
buffer's tip (``length == buffer.filled``); any other view copies its prefix first
(copy on write). Capacity grows by doubling, so decoding never copies the whole cache
per token, as gpt-fast's preallocated cache does.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

__all__ = ["KVCache"]

_MIN_CAPACITY = 64


class _Buffer:
    """Per-layer key and value tensors ``[rows, kv_heads, capacity, head_dim]``."""

    __slots__ = ("keys", "values", "capacity", "filled", "rows")

    def __init__(self, rows: int, capacity: int):
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.rows = rows
        self.capacity = capacity
        self.filled = 0


def _capacity_for(needed: int) -> int:
    capacity = _MIN_CAPACITY
    while capacity < needed:
        capacity *= 2
    return capacity


class KVCache:
    """An immutable view on the first ``length`` slots of a shared KV buffer.

    Parameters
    ----------
    buffer
        The shared storage.
    length
        How many leading slots (token positions of the padded layout) this view covers.
    """

    __slots__ = ("_buffer", "length")

    def __init__(self, buffer: _Buffer, length: int):
        self._buffer = buffer
        self.length = length

    @property
    def rows(self) -> int:
        return self._buffer.rows

    def __repr__(self) -> str:
        return f"KVCache(rows={self.rows}, length={self.length}, capacity={self._buffer.capacity})"

    def crop(self, length: int) -> "KVCache | None":
        """The view on the first ``min(length, self.length)`` slots (``None`` when empty)."""
        length = min(length, self.length)
        return KVCache(self._buffer, length) if length > 0 else None

    def select_rows(self, rows: torch.Tensor) -> "KVCache":
        """The cache of the given rows (indices may repeat, for forks and beams).

        Selecting every row in order returns the same view; any other selection copies
        the covered slots of the selected rows into a new buffer.
        """
        rows = torch.as_tensor(rows, dtype=torch.long)
        if rows.numel() == self.rows and torch.equal(rows, torch.arange(self.rows)):
            return self
        src = self._buffer
        new = _Buffer(rows.numel(), _capacity_for(self.length + 1))
        with torch.no_grad():
            for k, v in zip(src.keys, src.values):
                nk = k.new_empty((new.rows, k.shape[1], new.capacity, k.shape[3]))
                nv = v.new_empty((new.rows, v.shape[1], new.capacity, v.shape[3]))
                nk[:, :, : self.length] = k[rows, :, : self.length]
                nv[:, :, : self.length] = v[rows, :, : self.length]
                new.keys.append(nk)
                new.values.append(nv)
        new.filled = self.length
        return KVCache(new, self.length)


class ForwardCache(Cache):
    """The transformers ``Cache`` that one forward pass writes into.

    It appends ``n`` slots after ``start`` to a writable buffer and hands the model the
    keys and values of slots ``[0, start + n)``. Call :meth:`result` after the forward
    to get the new :class:`KVCache` view.
    """

    def __init__(self, cache: KVCache | None, rows: int, n_new: int):
        # Cache.__init__ wants layer objects we do not use: the buffer is the storage.
        self.layers = []
        self.layer_class_to_replicate = None
        self.offloading = False
        self.start = cache.length if cache is not None else 0
        self.end = self.start + n_new
        if cache is None:
            self._buffer = _Buffer(rows, _capacity_for(self.end))
        elif cache.length == cache._buffer.filled and self.end <= cache._buffer.capacity:
            self._buffer = cache._buffer  # the tip of its buffer: append in place
        else:
            self._buffer = self._copy_prefix(cache, _capacity_for(self.end))

    @staticmethod
    def _copy_prefix(cache: KVCache, capacity: int) -> _Buffer:
        src = cache._buffer
        if cache.length == src.filled:
            capacity = max(capacity, 2 * src.capacity)  # growing the tip: amortized doubling
        new = _Buffer(src.rows, capacity)
        for k, v in zip(src.keys, src.values):
            nk = k.new_empty((k.shape[0], k.shape[1], capacity, k.shape[3]))
            nv = v.new_empty((v.shape[0], v.shape[1], capacity, v.shape[3]))
            nk[:, :, : cache.length] = k[:, :, : cache.length]
            nv[:, :, : cache.length] = v[:, :, : cache.length]
            new.keys.append(nk)
            new.values.append(nv)
        return new

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        buf = self._buffer
        if layer_idx == len(buf.keys):  # first forward into a new buffer: allocate lazily
            shape = (buf.rows, key_states.shape[1], buf.capacity, key_states.shape[3])
            buf.keys.append(key_states.new_empty(shape))
            buf.values.append(value_states.new_empty(shape[:3] + (value_states.shape[3],)))
        keys, values = buf.keys[layer_idx], buf.values[layer_idx]
        keys[:, :, self.start : self.end] = key_states
        values[:, :, self.start : self.end] = value_states
        return keys[:, :, : self.end], values[:, :, : self.end]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.start

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.start + query_length, 0

    @property
    def is_compileable(self) -> bool:
        return False

    def result(self) -> KVCache:
        """The view covering ``[0, start + n)`` after the forward wrote it."""
        self._buffer.filled = self.end
        return KVCache(self._buffer, self.end)
