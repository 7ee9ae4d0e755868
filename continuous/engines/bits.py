"""Packed token masks: the one owner of their layout.

A row of ``words(n)`` int32 words holds one bit per token: bit ``t % 32`` of word
``t // 32`` (bit 31 is the sign bit). Engines write these rows on the host, a few KB
even for 128k vocabularies; the decoding loop copies them to the device and unpacks them
there.
"""

from __future__ import annotations

from typing import Callable, Iterable

import numpy as np
import torch

__all__ = ["words", "pack", "has", "clear", "only", "only_rows", "unpack", "bias", "fill_row"]


def words(n_tokens: int) -> int:
    """Words of a row covering ``n_tokens`` tokens."""
    return (n_tokens + 31) // 32


def _weights(device) -> torch.Tensor:
    # Bit 31's weight is negative: sums of distinct bits then fit an int32.
    return torch.tensor([1 << i for i in range(31)] + [-(1 << 31)], dtype=torch.int32, device=device)


def pack(ids: Iterable[int] | None, row: torch.Tensor, n_tokens: int) -> None:
    """Write the allowed ``ids`` (``None``: every id below ``n_tokens``) into an int32 row."""
    allowed = np.zeros(row.numel() * 32, dtype=bool)
    if ids is None:
        allowed[:n_tokens] = True
    else:
        allowed[np.fromiter(ids, dtype=np.int64)] = True
    row.copy_(torch.from_numpy(np.packbits(allowed, bitorder="little").view(np.int32)))


def has(row: torch.Tensor, token: int) -> bool:
    """Whether the row allows ``token``."""
    return bool(int(row[token // 32]) >> (token % 32) & 1)


def clear(row: torch.Tensor, token: int) -> None:
    """Forbid ``token`` in the row, in place."""
    row[token // 32] &= int(_weights("cpu")[token % 32]) ^ -1


def only(row: torch.Tensor) -> int | None:
    """The one token a row allows, or ``None`` when it allows none or several."""
    nonzero = row.nonzero()
    if nonzero.shape[0] != 1:
        return None
    at = int(nonzero[0, 0])
    word = int(row[at]) & 0xFFFFFFFF
    return at * 32 + word.bit_length() - 1 if word & (word - 1) == 0 else None


def only_rows(rows: torch.Tensor) -> list[int | None]:
    """:func:`only` of every row of ``[n, words]`` int32 rows, at once."""
    words = rows.numpy().view(np.uint32)
    nonzero = words != 0
    at = nonzero.argmax(1)
    word = words[np.arange(len(words)), at].astype(np.int64)
    single = (nonzero.sum(1) == 1) & (word & (word - 1) == 0)
    ids = at * 32 + np.log2(np.where(single, word, 1)).astype(np.int64)  # exact for a power of two
    return [int(i) if one else None for i, one in zip(ids, single)]


_UNPACK: dict = {}


def unpack(rows: torch.Tensor, n: int) -> torch.Tensor:
    """Boolean ``[rows, n]`` of packed int32 rows, computed on their device."""
    if rows.device.type == "cpu":
        # numpy unpacks bits in one pass; the device's way makes an int32 for each bit first
        # (16 rows of a 128k vocabulary: about 4 ms a step on a CPU, against 0.2 ms).
        packed = rows.contiguous().numpy().view(np.uint8)
        return torch.from_numpy(np.unpackbits(packed, axis=1, count=n, bitorder="little")).view(torch.bool)
    return _unpack_on_device(rows, n)


def _unpack_on_device(rows: torch.Tensor, n: int) -> torch.Tensor:
    """:func:`unpack` with tensor operations, which a device runs in parallel."""
    table = _UNPACK.get(rows.device)
    if table is None:
        table = _UNPACK[rows.device] = _weights(rows.device)
    return ((rows.unsqueeze(-1) & table) != 0).view(rows.shape[0], -1)[:, :n]


#: Per byte value, the bias of its 8 tokens (bit ``k``: token ``k``): 0 when allowed, ``-inf`` when not.
_BYTE_BIAS = np.where(np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little"),
                      np.float32(0), np.float32(-np.inf))


def bias(rows: torch.Tensor, n: int) -> torch.Tensor:
    """Float32 ``[rows, n]`` of packed int32 rows, 0 where a token is allowed and ``-inf`` where it
    is not: added to logits, it forbids what the rows do not allow. Computed on their device.

    On a CPU, making and adding it costs a fifth of ``masked_fill`` with the boolean mask, whose
    kernel is slow there: 0.7 against 4 ms for 16 rows of a 49,152-token vocabulary.
    """
    if rows.device.type == "cpu":
        table = np.take(_BYTE_BIAS, rows.contiguous().numpy().view(np.uint8), axis=0)
        return torch.from_numpy(table.reshape(rows.shape[0], -1)[:, :n])
    return _bias_on_device(rows, n)


def _bias_on_device(rows: torch.Tensor, n: int) -> torch.Tensor:
    """:func:`bias` with tensor operations, which a device runs in parallel."""
    return torch.zeros((rows.shape[0], n), device=rows.device).masked_fill_(~_unpack_on_device(rows, n), -torch.inf)


def fill_row(row: torch.Tensor, n_words: int, write: Callable[[torch.Tensor], None]) -> None:
    """Write a mask of ``n_words`` words into a row that may be wider (padded logits).

    ``write(row)`` fills an exact-width contiguous int32 CPU row. Words past ``n_words``
    are zeroed: ids beyond the tokenizer's vocabulary are never allowed.
    """
    if row.dim() != 1 or row.dtype != torch.int32 or row.device.type != "cpu":
        raise ValueError("the mask row must be a 1-D int32 CPU tensor")
    if row.numel() < n_words:
        raise ValueError(f"the mask row has {row.numel()} words; the vocabulary needs {n_words}")
    if row.numel() == n_words and row.is_contiguous():
        write(row)
        return
    scratch = torch.empty(n_words, dtype=torch.int32)
    write(scratch)
    row[:n_words].copy_(scratch)
    row[n_words:].zero_()
