"""The cache budget of a server, and the attention cache of one session."""

from __future__ import annotations

import logging
import threading

import torch

from continuous.remote.protocol import AllocationError

logger = logging.getLogger(__name__)


class MemoryBudget:
    """Bytes of attention cache a server may hold, shared by all its sessions.

    Sessions reserve their whole cache (``max_length`` tokens for every row) when they
    open, so a step never fails for lack of memory halfway through a generation.

    Parameters
    ----------
    max_bytes
        The budget.
    """

    def __init__(self, max_bytes: int):
        self.max_bytes = int(max_bytes)
        self.used_bytes = 0
        self._lock = threading.Lock()

    @property
    def free_bytes(self) -> int:
        return self.max_bytes - self.used_bytes

    def reserve(self, nbytes: int) -> None:
        """Reserve ``nbytes``, or raise :class:`AllocationError` if they do not fit."""
        with self._lock:
            if nbytes > self.free_bytes:
                raise AllocationError(
                    f"session needs {nbytes} bytes of attention cache but the server has {self.free_bytes} "
                    f"of {self.max_bytes} bytes free"
                )
            self.used_bytes += nbytes

    def release(self, nbytes: int) -> None:
        with self._lock:
            self.used_bytes -= nbytes


class SessionCache:
    """Preallocated keys and values of a span of blocks for one session.

    It offers the ``update(key, value, layer_idx)`` call that transformers' attention
    modules make on a cache, writing at the session's current length; rewinding and
    row selection are done between steps by :meth:`prepare`.

    Parameters
    ----------
    first_layer
        Global index of the first block (attention modules call with global indices).
    n_layers, batch_size, n_kv_heads, max_length, head_dim, dtype
        Shape and type of the cache.
    """

    def __init__(self, first_layer: int, n_layers: int, batch_size: int, n_kv_heads: int, max_length: int,
                 head_dim: int, dtype: torch.dtype):
        shape = (n_layers, batch_size, n_kv_heads, max_length, head_dim)
        self.first_layer = first_layer
        self.keys = torch.empty(shape, dtype=dtype)
        self.values = torch.empty(shape, dtype=dtype)
        self.rows = 0
        self.length = 0
        self._start = 0

    @staticmethod
    def nbytes(n_layers: int, batch_size: int, n_kv_heads: int, max_length: int, head_dim: int,
               dtype: torch.dtype) -> int:
        return 2 * n_layers * batch_size * n_kv_heads * max_length * head_dim * dtype.itemsize

    def prepare(self, start: int, rows: int, hypo_ids: torch.Tensor | None) -> None:
        """Keep the first ``start`` positions, then select rows ``hypo_ids`` (if given)."""
        self.length = self._start = start
        if hypo_ids is not None and start > 0:
            # Advanced indexing copies first, so overlapping source and target rows are safe.
            self.keys[:, :rows, :, :start] = self.keys[:, hypo_ids, :, :start]
            self.values[:, :rows, :, :start] = self.values[:, hypo_ids, :, :start]
        self.rows = rows

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        i, end = layer_idx - self.first_layer, self._start + key.shape[2]
        self.keys[i, : self.rows, :, self._start : end] = key
        self.values[i, : self.rows, :, self._start : end] = value
        return self.keys[i, : self.rows, :, :end], self.values[i, : self.rows, :, :end]

    def commit(self, n_new: int) -> None:
        """Record that a step wrote ``n_new`` positions in every layer."""
        self.length = self._start + n_new
