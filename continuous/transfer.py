"""Host <-> device transfers that never make the host wait for the device's queued work.

A plain ``torch.tensor(data, device="cuda")`` or ``.tolist()`` synchronizes: the host stops
until every kernel queued before it has run, and a decode step's host work can no longer
overlap the device's. These go through pinned memory with ``non_blocking`` copies (the
caching host allocator keeps a pinned block until the copies that read it are done). On a
CPU they are the plain operations. :func:`cat_rows` joins row blocks with no copy at all
where they are already one tensor's.
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["cat_rows", "owned", "split_rows", "to_device", "to_host"]


#: Rows of fewer bytes than this are copied: checking that they are one tensor's costs more.
VIEW_BYTES = 1 << 18


def split_rows(t: torch.Tensor, counts: list[int]) -> tuple[torch.Tensor, ...]:
    """``t.split(counts)``, each block knowing where in ``t`` it lies: :func:`cat_rows` of the
    blocks, in order, gives back ``t`` (or its rows) at once, with nothing checked on the device."""
    if len(counts) == 1:
        return (t,)
    parts, at = t.split(counts), 0
    for part, n in zip(parts, counts):
        part._rows_of = (t, at, at + n)
        at += n
    return parts


def cat_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(parts)``; a view, with nothing copied, when the parts are consecutive row blocks
    of one tensor, in order (what a split of it handed out: the calls of an engine step hand back
    the rows of the step before's tensors): blocks of :func:`split_rows`, or blocks of at least
    :data:`VIEW_BYTES` in all."""
    first = parts[0]
    if len(parts) == 1:
        return first
    whole = _whole_of(parts)
    if whole is not None:
        return whole
    if not first.dim() or first.nelement() * first.element_size() * len(parts) < VIEW_BYTES:
        return torch.cat(parts)  # (scalars: torch.cat says why not)
    # Told by addresses, not by ``_base``: the views of a tensor made in inference mode (a
    # model's logits) have none.
    shape, stride, dtype, at = first.shape[1:], first.stride(), first.dtype, first.data_ptr()
    row_bytes, rows = stride[0] * first.element_size(), 0
    for p in parts:
        if p.data_ptr() != at + rows * row_bytes or p.stride() != stride or p.shape[1:] != shape or p.dtype != dtype:
            return torch.cat(parts)  # not one tensor's blocks (or blocks torch.cat refuses: it says why)
        rows += p.shape[0]
    try:
        # Only a tensor whose memory holds every part fits the view: parts of other tensors
        # that merely follow it in memory make as_strided refuse.
        return first.as_strided((rows, *shape), stride)
    except RuntimeError:
        return torch.cat(parts)


def _whole_of(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """The rows of one tensor that ``parts`` are, in order, as :func:`split_rows` handed them out
    (``None``: they are not)."""
    origin = getattr(parts[0], "_rows_of", None)
    if origin is None:
        return None
    whole, start, stop = origin
    for p in parts[1:]:
        origin = getattr(p, "_rows_of", None)
        if origin is None or origin[0] is not whole or origin[1] != stop:
            return None
        stop = origin[2]
    return whole if start == 0 and stop == whole.shape[0] else whole[start:stop]


def owned(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t``, or a copy of it when it is a view into more memory than its own (its rows of a
    tensor that several calls' step shared): what a call keeps past its end then holds no
    other call's rows."""
    if t is None or t.untyped_storage().nbytes() <= t.nelement() * t.element_size():
        return t
    return t.clone()


def to_device(data, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``data`` (nested lists of numbers, or a CPU tensor) as a tensor on ``device``, copied
    behind the work already queued there, without waiting for it."""
    if isinstance(data, torch.Tensor) and data.device == device and (dtype is None or data.dtype == dtype):
        return data  # already there (most tensors of a step): no dispatch at all
    host = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
    if dtype is not None and host.dtype != dtype:
        host = host.to(dtype)
    if device.type != "cuda" or host.device.type != "cpu":
        return host.to(device)
    if not host.is_pinned():
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def to_host(*tensors: torch.Tensor) -> Callable[[], list]:
    """Start copying ``tensors`` to the host; returns a function that waits for them and gives
    each one's ``tolist()`` (a list of them, one per tensor).

    On CUDA the copies go to pinned memory behind one event, so that work queued after
    them does not delay them (a plain ``tolist()`` would wait for that work too).
    """
    if tensors[0].device.type != "cuda":
        values = [t.tolist() for t in tensors]
        return lambda: values
    hosts = []
    for t in tensors:
        hosts.append(torch.empty(t.shape, dtype=t.dtype, pin_memory=True))
        hosts[-1].copy_(t, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()

    def wait():
        copied.synchronize()
        return [host.tolist() for host in hosts]

    return wait
