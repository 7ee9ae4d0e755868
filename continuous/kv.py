"""The local KV cache as a value, and the transformers ``Cache`` that one forward writes into.

A :class:`KVCache` is a view ``(buffer, length)`` on a preallocated buffer shared by
every state that grew from the same computation. Slots ``[0, length)`` of a buffer are
never written again once filled, so a shorter view (a cropped state, an older state)
stays valid when a longer one appends. A view appends in place only when it is the
buffer's tip; the tip is *claimed* under the buffer's lock, so two threads continuing
states that share a tip never write the same slots: the second one copies its prefix
(copy on write). Capacity grows by doubling, so decoding never copies the whole cache
per token, as gpt-fast's preallocated cache does.

:class:`ForwardCache` is a ``transformers.Cache`` with one layer object per model
layer and the layer's kind (full or sliding-window attention). transformers builds
each layer kind's mask from the 2D mask and these layers; hybrid models (Gemma 2/3)
need no code of ours. Sliding-window layers keep every slot too: a state may be
rewound or cropped anywhere, which a rolling window could not serve.
"""

from __future__ import annotations

import inspect
import itertools
import threading
import weakref
from typing import Callable

import torch
from transformers import GenerationMixin
from transformers.cache_utils import Cache, CacheLayerMixin

from .transfer import to_device

__all__ = ["CACHE_ARG", "KVCache", "ForwardCache", "StaticStepCache", "capacity_for", "stack", "JointRows", "Slots",
           "Shape"]

_MIN_CAPACITY = 64

#: The keyword under which transformers' ``forward()`` and ``generate()`` take a cache:
#: ``cache`` since transformers renamed ``past_key_values`` (which it still accepts for a
#: while, with a warning, in models but not in a model class of ours).
CACHE_ARG = ("cache" if "cache" in inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
             else "past_key_values")


class _Buffer:
    """Every layer's keys and values, ``[rows, kv_heads, capacity, head_dim]`` (``keys``, ``values``).

    They are views of one tensor per group of consecutive layers of one shape (``groups``:
    keys and values ``[layers, rows, kv_heads, capacity, head_dim]``), so that copying some
    rows or slots of every layer is two operations per group, not two per layer. A group
    holds at most :data:`GROUP_BYTES`: on a CPU, a larger allocation is fresh memory from
    the system each time, every page of it faulted in as it is written.
    """

    __slots__ = ("groups", "keys", "values", "capacity", "filled", "rows", "lock", "static", "grouped", "__weakref__")

    def __init__(self, rows: int, capacity: int):
        self.groups: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.grouped = False  # whether layers share a group (else each is one; see allocate)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.rows = rows
        self.capacity = capacity
        self.filled = 0  # slots claimed by a view: only the tip (length == filled) appends in place
        self.lock = threading.Lock()
        self.static = None  # the StaticStepCache of compiled steps into this buffer

    def claim(self, start: int, end: int) -> bool:
        """Atomically take slots ``[start, end)`` for appending in place, if ``start`` is the tip."""
        with self.lock:
            if start == self.filled and end <= self.capacity:
                self.filled = end
                return True
            return False

    def allocate(self, shapes: list[Shape], dtype: torch.dtype, grouped: bool, zeroed: bool = True) -> None:
        """Zeroed layers after those held, of the given :data:`Shape`; ``grouped``: runs of one
        shape share a group, of at most :data:`GROUP_BYTES` (else each layer is a group of its
        own: what a compiled step takes).

        Zeros, not empty memory: a compiled step attends over the whole capacity, and a NaN
        bit pattern in an unused slot would leak through a zero weight. Without ``zeroed``
        the memory is left as it is, for a caller that writes every slot itself.
        """
        self.grouped = grouped
        make = torch.zeros if zeroed else torch.empty
        for count, (heads, key_dim, value_dim, device) in _runs(shapes):
            layer = self.rows * heads * self.capacity * max(key_dim, value_dim) * dtype.itemsize
            most = max(1, GROUP_BYTES // layer) if grouped else 1
            for n in [most] * (count // most) + [count % most] * bool(count % most):
                keys = make((n, self.rows, heads, self.capacity, key_dim), dtype=dtype, device=device)
                values = make((n, self.rows, heads, self.capacity, value_dim), dtype=dtype, device=device)
                self.groups.append((keys, values))
                self.keys += keys.unbind(0)
                self.values += values.unbind(0)

    def shapes(self) -> list[Shape]:
        """Per layer, its :data:`Shape`."""
        return [(k.shape[1], k.shape[3], v.shape[3], k.device) for k, v in zip(self.keys, self.values)]

    def bounds(self) -> list[int]:
        """Where each group starts, and the number of layers."""
        starts = [0]
        for keys, _ in self.groups:
            starts.append(starts[-1] + keys.shape[0])
        return starts

    def span(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of layers ``[first, first + count)``, which lie in one group, as views:
        ``[count, rows, kv_heads, capacity, dim]``."""
        for start, (keys, values) in zip(self.bounds(), self.groups):
            if start <= first and first + count <= start + keys.shape[0]:
                return keys[first - start : first - start + count], values[first - start : first - start + count]
        raise ValueError(f"layers [{first}, {first + count}) are not in one group")

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for group in self.groups for t in group)


#: The most bytes one tensor of a buffer's group of layers takes (see :class:`_Buffer`).
GROUP_BYTES = 8 << 20

#: A layer's ``(kv_heads, key_dim, value_dim, device)``: layers of one shape on one device
#: (a model split over devices has several) may share a group.
Shape = tuple[int, int, int, torch.device]


def _runs(shapes: list[Shape]) -> list[tuple[int, Shape]]:
    """``(count, shape)`` of each run of consecutive layers of one shape."""
    return [(len(list(run)), shape) for shape, run in itertools.groupby(shapes)]


def _pieces(*bounds: list[int]) -> list[tuple[int, int]]:
    """``(first, count)`` of the runs of layers that lie in one group of every buffer whose group
    ``bounds`` are given (:meth:`_Buffer.bounds`)."""
    cuts = sorted(set().union(*bounds))
    return [(a, b - a) for a, b in zip(cuts, cuts[1:])]


def capacity_for(needed: int) -> int:
    """The capacity (a power of two, at least 64) that holds ``needed`` slots."""
    capacity = _MIN_CAPACITY
    while capacity < needed:
        capacity *= 2
    return capacity


def _copied(buffer: _Buffer, rows: int, length: int, capacity: int, write: Callable) -> _Buffer:
    """A new buffer of ``rows`` rows whose slots ``[0, length)`` ``write(keys_or_values, out)``
    fills: ``keys_or_values`` is some layers of ``buffer``, ``[layers, its rows, kv_heads,
    capacity, dim]``, and ``out`` the same layers of the new buffer, ``[layers, rows,
    kv_heads, length, dim]``."""
    new = _Buffer(rows, capacity)
    # Inference tensors, as those a forward allocates: a compiled step is specialized on
    # the kind of tensor, so a copied buffer of another kind would compile it again.
    with torch.inference_mode():
        # Left empty, not zeroed: the copy writes the slots up to ``length``, and only those past
        # it are zeroed (zeroing all of it first would write most of the memory twice).
        new.allocate(buffer.shapes(), buffer.keys[0].dtype, buffer.grouped, zeroed=False)
        for first, count in _pieces(buffer.bounds(), new.bounds()):
            for t, out in zip(buffer.span(first, count), new.span(first, count)):
                write(t, out[:, :, :, :length])
                out[:, :, :, length:].zero_()
    new.filled = length
    return new


def _gather(buffer: _Buffer, rows: torch.Tensor | None, slots: torch.Tensor | None, length: int,
            capacity: int) -> _Buffer:
    """A new buffer holding ``length`` slots of ``buffer``: the given rows, and per row the given slots.

    ``rows`` (``[new_rows]``) selects rows (``None``: all); ``slots`` (``[new_rows, length]``)
    picks, per new row, which old slots fill its slots ``[0, length)`` (``None``: the same slots).
    """
    def write(t: torch.Tensor, out: torch.Tensor) -> None:
        src = t[:, :, :, :length] if slots is None else t
        if rows is not None:
            src = src.index_select(1, rows.to(t.device))
        if slots is not None:
            idx = slots.to(t.device)[None, :, None, :, None]
            src = src.gather(3, idx.expand(t.shape[0], -1, t.shape[2], -1, t.shape[4]))
        out.copy_(src)

    return _copied(buffer, buffer.rows if rows is None else rows.numel(), length, capacity, write)


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
    movable = True

    def __init__(self, buffer: _Buffer, length: int):
        self._buffer = buffer
        self.length = length

    @property
    def rows(self) -> int:
        return self._buffer.rows

    @property
    def capacity(self) -> int:
        return self._buffer.capacity

    def __repr__(self) -> str:
        return f"KVCache(rows={self.rows}, length={self.length}, capacity={self._buffer.capacity})"

    def crop(self, length: int) -> "KVCache | None":
        """The view on the first ``min(length, self.length)`` slots (``None`` when empty)."""
        length = min(length, self.length)
        return KVCache(self._buffer, length) if length > 0 else None

    def storage(self) -> tuple[_Buffer, int]:
        """The buffer that holds this view's memory, and its size in bytes (its whole capacity)."""
        buffer = self.holder()
        return buffer, buffer.nbytes

    @property
    def layers(self) -> int:
        """How many model layers the buffer holds (none before a first forward fills it)."""
        return len(self.holder().keys)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``index``'s keys and values of the slots ``[0, length)``: ``[rows, kv_heads, length, head_dim]``."""
        buffer = self._buffer
        return buffer.keys[index][:, :, : self.length], buffer.values[index][:, :, : self.length]

    def holder(self) -> _Buffer:
        """The buffer its slots lie in now (read, never copied out: see :class:`JointRows`)."""
        return self._buffer

    def span(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values of layers ``[first, first + count)``, which lie in one group of the
        buffer, of the slots ``[0, length)``: ``[count, rows, kv_heads, length, dim]``."""
        keys, values = self._buffer.span(first, count)
        return keys[:, :, :, : self.length], values[:, :, :, : self.length]

    def settle(self) -> None:
        """Make the value hold only its own rows' memory (it already does: nothing to copy)."""

    def part(self, rows: slice, slots: "Slots") -> "JointRows":
        """Some of its rows and slots (``slots``, of ``[0, length)``), left where they are until read."""
        return JointRows(self._buffer, rows, slots)

    def release(self, length: int) -> None:
        """Give back this view's slots past ``length`` to its buffer: the view is being discarded.

        The view of ``length`` slots then appends in place again, unless another view
        claimed slots since.
        """
        with self._buffer.lock:
            if self._buffer.filled == self.length and length < self.length:
                self._buffer.filled = length

    def select_rows(self, rows: torch.Tensor) -> "KVCache":
        """The cache of the given rows (indices may repeat, for forks and beams).

        Selecting every row in order returns the same view; any other selection copies
        the covered slots of the selected rows into a new buffer.
        """
        rows = torch.as_tensor(rows, dtype=torch.long)
        if rows.numel() == self.rows and torch.equal(rows.cpu(), torch.arange(self.rows)):
            return self
        return KVCache(_gather(self._buffer, rows, None, self.length, capacity_for(self.length + 1)), self.length)

    def gather_rows_slots(self, rows: torch.Tensor, slots: torch.Tensor) -> "KVCache | None":
        """A compacted copy: its row ``i`` slot ``j`` is this view's row ``rows[i]`` slot ``slots[i, j]``.

        Used to squeeze out holes: positions are part of the keys (rotary embeddings are
        applied before caching), so moving a slot does not change what it means.
        """
        length = slots.shape[1]
        if length == 0:
            return None
        return KVCache(_gather(self._buffer, rows, slots, length, capacity_for(length + 1)), length)


class _Layer(CacheLayerMixin):
    """One model layer's view of a :class:`ForwardCache`: writes its new slots into the buffer."""

    is_compileable = False
    is_croppable = True

    def __init__(self, owner: "ForwardCache", index: int, sliding: bool):
        super().__init__()
        self.owner, self.index, self.is_sliding = owner, index, sliding
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:  # storage is the shared buffer
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        owner, buf = self.owner, self.owner._buffer
        if self.index == len(buf.keys):  # the first forward into a new buffer allocates lazily
            shape = (key_states.shape[1], key_states.shape[3], value_states.shape[3], key_states.device)
            # With every layer's shape known, all of them at once (grouped); else this one.
            known = owner.shapes[self.index :] if owner.shapes is not None else []
            later = known if known[:1] == [shape] else [shape]
            buf.allocate(later, key_states.dtype, grouped=len(later) > 1)
        keys, values = buf.keys[self.index], buf.values[self.index]
        keys[:, :, owner.start : owner.end] = key_states
        values[:, :, owner.start : owner.end] = value_states
        return keys[:, :, : owner.end], values[:, :, : owner.end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.start + query_length, 0

    def get_seq_length(self) -> int:
        return self.owner.start

    def get_max_length(self) -> int:
        return -1


class ForwardCache(Cache):
    """The transformers ``Cache`` one forward pass writes into.

    It appends ``n_new`` slots after ``cache.length`` and hands each layer the keys and
    values of slots ``[0, start + n_new)``. Call :meth:`result` after the forward to get
    the new :class:`KVCache` view.

    Parameters
    ----------
    cache
        The view continued, or ``None`` for a fresh buffer.
    rows, n_new
        Rows of the forward and slots it appends.
    layer_kinds
        Per model layer, whether it is a sliding-window layer.
    reserve
        Slots a new buffer holds at least (the length of a prompt forwarded in chunks).
    shapes
        Per model layer, its :data:`Shape`, when known (from an earlier forward): a new
        buffer then allocates its layers grouped by shape.
    """

    def __init__(self, cache: KVCache | None, rows: int, n_new: int, layer_kinds: list[bool], reserve: int = 0,
                 shapes: list[Shape] | None = None):
        self.shapes = shapes
        self.start = cache.length if cache is not None else 0
        self.end = self.start + n_new
        if cache is None:
            self._buffer = _Buffer(rows, capacity_for(max(self.end, reserve)))
            self._buffer.filled = self.end
        elif cache._buffer.claim(self.start, self.end):
            self._buffer = cache._buffer  # the tip of its buffer: append in place
        else:
            src = cache._buffer
            capacity = capacity_for(max(self.end, reserve))
            if cache.length == src.filled:
                capacity = max(capacity, 2 * src.capacity)  # growing the tip: amortized doubling
            self._buffer = _gather(src, None, None, cache.length, capacity)
            self._buffer.filled = self.end
        # The layers reach this cache through a weak proxy: a cycle would keep the buffer (the KV
        # memory) of a state dropped since until the garbage collector next runs, which an idle
        # process may not do for a long time.
        owner = weakref.proxy(self)
        super().__init__(layers=[_Layer(owner, i, sliding) for i, sliding in enumerate(layer_kinds)])

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.start

    def abort(self) -> None:
        """Give back the claimed slots after a failed forward: the continued view stays the tip."""
        self.trim(0)

    def trim(self, n: int) -> None:
        """Keep only the first ``n`` slots written (pads of a compiled step were written past them).

        The slots past them go back to the buffer: the next forward claims and overwrites them.
        """
        self.result().release(self.start + n)
        self.end = self.start + n

    def result(self) -> KVCache:
        """The view covering ``[0, start + n_new)`` after the forward wrote it."""
        return KVCache(self._buffer, self.end)


class _StaticLayer(_Layer):
    """A layer of :class:`StaticStepCache`: writes its slots at tensor indices, returns the whole capacity."""

    is_compileable = True
    is_croppable = False

    def update(self, key_states, value_states, *args, **kwargs):
        keys, values = self.owner.keys[self.index], self.owner.values[self.index]
        keys.index_copy_(2, self.owner.write_at, key_states)
        values.index_copy_(2, self.owner.write_at, value_states)
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.capacity, 0

    def get_seq_length(self) -> int:
        return self.owner.write_at[0]

    def get_max_length(self) -> int:
        return self.owner.capacity


class StaticStepCache(Cache):
    """The transformers ``Cache`` of a compiled decode step: fixed shapes throughout.

    Every layer writes its new slots at ``write_at`` (a tensor of slot indices, so that
    a compiled step is not specialized on where it writes) into the full-capacity buffer
    and attends over all of it; the masks say which slots count. Build it from a
    :class:`ForwardCache` that claimed the slots, so copy on write and the tip's lock
    work as for any forward.
    """

    def __init__(self, buf: _Buffer, layer_kinds: list[bool], write_at: torch.Tensor, static: bool = True):
        self.keys, self.values, self.capacity, self.write_at = buf.keys, buf.values, buf.capacity, write_at
        self.static = static
        for t in self.keys + self.values:
            if static:
                # A static address, as HF's StaticCache marks its own: CUDA graphs write the
                # buffer in place instead of copying it in as an input at every step.
                # Unguarded, so that a new buffer (a new state, a grown capacity) re-records
                # a graph rather than recompiling.
                torch._dynamo.mark_static_address(t, guard=False)
            elif hasattr(t, "_dynamo_static_input_type"):
                del t._dynamo_static_input_type
        super().__init__(layers=[_StaticLayer(self, i, sliding) for i, sliding in enumerate(layer_kinds)])

    @classmethod
    def of(cls, fc: ForwardCache, layer_kinds: list[bool], write_at: torch.Tensor,
           static: bool = True) -> "StaticStepCache":
        """The step cache of the buffer ``fc`` writes into (made once per buffer), writing at ``write_at``.

        ``static`` marks the buffer's tensors as static addresses (for CUDA graphs). It
        must be False where inductor freezes the step: there a static tensor becomes a
        constant of the compiled graph, and every later buffer would be read and written
        as the one the step was compiled with.
        """
        buf = fc._buffer
        if buf.static is None or buf.static.static != static:
            buf.static = cls(buf, layer_kinds, write_at, static)
        buf.static.write_at = write_at
        return buf.static


def stack(caches: "list[KVCache | None]", rows: list[int], extra: int) -> "KVCache | None":
    """One cache whose rows are the given caches' rows, one after the other.

    Each cache's slots ``[0, length)`` are copied to the same slots of its rows; slots past
    a shorter cache are zeros (the caller's mask makes them holes). ``rows`` gives each
    part's row count (a ``None`` part is all zeros), ``extra`` the slots to leave room for.
    Returns ``None`` when no part holds anything.
    """
    like = next((c for c in caches if c is not None and c.length and c.layers), None)
    if like is None:
        return None
    length = max(c.length if c is not None else 0 for c in caches)
    # Zeros, not empty memory: holes are attended to with a zero weight, and a compiled
    # step attends over the whole capacity, so every slot must hold numbers.
    out = _Buffer(sum(rows), capacity_for(length + extra))
    with torch.inference_mode():
        model = like.holder()
        out.allocate(model.shapes(), model.keys[0].dtype, model.grouped)
        at = 0
        for cache, n in zip(caches, rows):
            if cache is not None and cache.length:
                for first, count in _pieces(out.bounds(), cache.holder().bounds()):
                    keys, values = out.span(first, count)
                    keys[:, at : at + n, :, : cache.length], values[:, at : at + n, :, : cache.length] = (
                        cache.span(first, count))
            at += n
    out.filled = length
    return KVCache(out, length)


class Slots:
    """Slots of a stacked buffer, in order: ``base`` (a tensor, or a run), then the run ``tail``.

    Merged steps append each call's new slots as a run right after the last one, so a
    call's slots grow by extending ``tail``, with no tensor made per step; :meth:`tensor`
    makes them one tensor when something reads them. A value, never changed: the calls that
    hold the same slots (stacked together) share one.
    """

    __slots__ = ("base", "tail", "_based")
    _NONE = torch.zeros(0, dtype=torch.long)

    def __init__(self, base: torch.Tensor | range | None = None, tail: range = range(0), based: int | None = None):
        self.base, self.tail = self._NONE if base is None else base, tail
        self._based = len(self.base) if based is None else based  # read at every step: kept, not asked of the tensor

    def __len__(self) -> int:
        return self._based + len(self.tail)

    def then(self, new: range) -> "Slots":
        """These slots followed by ``new``."""
        if not self.tail or self.tail.stop == new.start:
            return Slots(self.base, range(self.tail.start if self.tail else new.start, new.stop), self._based)
        return Slots(self.tensor(), new)

    def tensor(self) -> torch.Tensor:
        base = torch.arange(self.base.start, self.base.stop) if isinstance(self.base, range) else self.base
        if not self._based:
            return torch.arange(self.tail.start, self.tail.stop)
        if not self.tail:
            return base
        return torch.cat([base, torch.arange(self.tail.start, self.tail.stop)])


class JointRows(KVCache):
    """One call's rows of a merged forward's stacked cache, copied into a buffer of their own
    only when something reads them.

    A merged round hands each call this value instead of copying the call's new slots
    into the call's own buffer: while the same calls go on together, the next round
    continues the stacked cache and nothing is ever copied. The copy (the call's slots,
    gathered) is made once, when the value is continued alone, cropped, stored or
    stacked again, and the stacked buffer is then no longer held.

    Parameters
    ----------
    source
        The stacked buffer.
    rows
        The call's rows in it.
    slots
        Per slot of the call's cache, in order, its slot in the stacked buffer.
    """

    __slots__ = ("_source", "_rows", "slots", "_index", "_own", "__weakref__")
    _copying = threading.Lock()

    def __init__(self, source: _Buffer, rows: slice, slots: Slots):
        self._source, self._rows, self.slots, self._index, self._own = source, rows, slots, None, None
        self.length = len(slots)

    @property
    def _slots(self) -> torch.Tensor:
        """The slots as one tensor on the buffer's device (made once)."""
        if self._index is None:
            self._index = to_device(self.slots.tensor(), self._source.keys[0].device if self._source.keys
                                    else torch.device("cpu"))
        return self._index

    @property
    def rows(self) -> int:
        return self._rows.stop - self._rows.start

    @property
    def _buffer(self) -> _Buffer:
        return self._own if self._own is not None else self.settle()

    def _held(self) -> tuple[_Buffer | None, _Buffer | None]:
        """Their own buffer once copied (else ``None``), and the stacked one until then."""
        with self._copying:
            return self._own, self._source

    def holder(self) -> _Buffer:
        """The stacked buffer while the rows are in it (it holds their memory), then their own."""
        own, source = self._held()
        return own or source

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        own, source = self._held()
        if own is not None:
            return own.keys[index][:, :, : self.length], own.values[index][:, :, : self.length]
        return (source.keys[index][self._rows].index_select(2, self._slots),
                source.values[index][self._rows].index_select(2, self._slots))

    def span(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        own, source = self._held()
        if own is not None:
            return KVCache(own, self.length).span(first, count)
        return tuple(self._take(t) for t in source.span(first, count))

    def _take(self, t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The rows' slots, in order, of ``t`` (a group of the stacked buffer: ``[layers, rows,
        kv_heads, capacity, dim]``), copied into ``out`` when given."""
        rows, slots = t[:, self._rows], self.slots
        if not len(slots.base):  # one run of slots (most calls: stacked once, then appended to): a slice
            taken = rows[:, :, :, slots.tail.start : slots.tail.stop]
            return taken if out is None else out.copy_(taken)
        if isinstance(slots.base, range):  # two runs (a call's rows of a table: see decode.joined): two slices
            runs = [rows[:, :, :, r.start : r.stop] for r in (slots.base, slots.tail)]
            if out is None:
                return torch.cat(runs, 3)
            out[:, :, :, : len(slots.base)].copy_(runs[0])
            out[:, :, :, len(slots.base) :].copy_(runs[1])
            return out
        if out is None:
            return rows.index_select(3, self._slots)
        return torch.index_select(rows, 3, self._slots, out=out)

    def part(self, rows: slice, slots: Slots) -> "JointRows":
        own, source = self._held()
        if own is not None:
            return JointRows(own, rows, slots)
        # Still in the stacked buffer: its rows of these rows, its slots of these slots.
        at = self._rows.start
        return JointRows(source, slice(at + rows.start, at + rows.stop), Slots(self.slots.tensor()[slots.tensor()]))

    def settle(self) -> _Buffer:
        """The rows' own buffer, copied out on the first call (the stacked one is then no longer held)."""
        with self._copying:
            if self._own is None:
                self._own = _copied(self._source, self.rows, self.length, capacity_for(self.length + 1), self._take)
                self._source = None
        return self._own
