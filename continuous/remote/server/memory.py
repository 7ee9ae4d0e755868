"""The cache budget of a server, and the attention cache of one session."""

from __future__ import annotations

import logging
import threading

import torch

from continuous.remote.wire.protocol import AllocationError

logger = logging.getLogger(__name__)


class MemoryBudget:
    """Bytes of attention cache a server may hold, shared by all its sessions.

    Sessions reserve what they hold: their rows and a length that grows on demand (see
    :class:`SessionCache`), so a budget fits many short sessions, not only a few sized
    for their worst case. A step that needs more than is free fails with
    :class:`AllocationError` before any compute, and the client moves the session.

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
    """Keys, values and positions of a span of blocks for one session, grown on demand.

    It offers the ``update(key, value, layer_idx)`` call that transformers' attention
    modules make on a cache, writing at the session's current length; rewinding and
    row selection are done between steps by :meth:`prepare`. Storage grows (doubling
    its length, up to ``max_length``) when a step needs it, and each growth is charged
    to ``budget``; :meth:`release` gives it all back.

    Parameters
    ----------
    first_layer
        Global index of the first block (attention modules call with global indices).
    n_layers, n_kv_heads, head_dim, dtype
        Shape and type of the cache.
    max_length
        Most positions the session may hold.
    budget
        The server's budget, charged for what is allocated.
    """

    #: Positions allocated at the first step, at least.
    MIN_LENGTH = 64

    def __init__(self, first_layer: int, n_layers: int, n_kv_heads: int, max_length: int, head_dim: int,
                 dtype: torch.dtype, budget: MemoryBudget):
        self.first_layer, self.max_length, self.budget = first_layer, max_length, budget
        self._shape = (n_layers, 0, n_kv_heads, 0, head_dim)
        self.keys = self.values = torch.empty(self._shape, dtype=dtype)
        self.positions = torch.empty(0, 0, dtype=torch.int64)
        self.nbytes = 0
        self.rows = 0
        self.length = 0
        self._start = 0

    @staticmethod
    def nbytes_for(n_layers: int, rows: int, n_kv_heads: int, length: int, head_dim: int,
                   dtype: torch.dtype) -> int:
        """Bytes of keys, values and positions of ``rows`` rows of ``length`` positions."""
        return rows * length * (2 * n_layers * n_kv_heads * head_dim * dtype.itemsize + 8)

    def reserve(self, rows: int, length: int) -> None:
        """Make room for ``rows`` rows of ``length`` positions, charging the budget.

        Raises
        ------
        AllocationError
            The budget has no room; nothing changed.
        """
        self._grow(rows, length)

    def _grow(self, rows: int, length: int) -> None:
        n_layers, held_rows, heads, held_length, head_dim = self.keys.shape
        if rows <= held_rows and length <= held_length:
            return
        rows = max(rows, held_rows)
        length = min(self.max_length, max(length, 2 * held_length, self.MIN_LENGTH))
        nbytes = self.nbytes_for(n_layers, rows, heads, length, head_dim, self.keys.dtype)
        self.budget.reserve(nbytes - self.nbytes)  # raises AllocationError: nothing changed yet
        try:
            keys = torch.empty(n_layers, rows, heads, length, head_dim, dtype=self.keys.dtype)
            values = torch.empty_like(keys)
            positions = torch.empty(rows, length, dtype=torch.int64)
        except BaseException:
            self.budget.release(nbytes - self.nbytes)
            raise
        keys[:, :held_rows, :, :held_length] = self.keys
        values[:, :held_rows, :, :held_length] = self.values
        positions[:held_rows, :held_length] = self.positions
        self.keys, self.values, self.positions, self.nbytes = keys, values, positions, nbytes

    def release(self) -> None:
        """Free the storage and give its bytes back to the budget."""
        self.budget.release(self.nbytes)
        self.nbytes = 0
        self.keys = self.values = torch.empty(self._shape, dtype=self.keys.dtype)
        self.positions = torch.empty(0, 0, dtype=torch.int64)

    def prepare(self, start: int, rows: int, n: int, hypo_ids: torch.Tensor | None) -> None:
        """Keep the first ``start`` positions, select rows ``hypo_ids`` (if given), make room for ``n`` more."""
        self._grow(rows, start + n)
        self.length = self._start = start
        if hypo_ids is not None and start > 0:
            # Advanced indexing copies first, so overlapping source and target rows are safe.
            self.keys[:, :rows, :, :start] = self.keys[:, hypo_ids, :, :start]
            self.values[:, :rows, :, :start] = self.values[:, hypo_ids, :, :start]
            self.positions[:rows, :start] = self.positions[hypo_ids, :start]
        self.rows = rows

    def write_positions(self, position_ids: torch.Tensor) -> torch.Tensor:
        """Record the positions of the new slots; return the positions of all slots, [rows, start + n]."""
        end = self._start + position_ids.shape[1]
        self.positions[: self.rows, self._start : end] = position_ids
        return self.positions[: self.rows, :end]

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        i, end = layer_idx - self.first_layer, self._start + key.shape[2]
        self.keys[i, : self.rows, :, self._start : end] = key
        self.values[i, : self.rows, :, self._start : end] = value
        return self.keys[i, : self.rows, :, :end], self.values[i, : self.rows, :, :end]

    def commit(self, n_new: int) -> None:
        """Record that a step wrote ``n_new`` positions in every layer."""
        self.length = self._start + n_new
