"""What a backend offers to the decoding loop.

A backend owns a tokenizer, counts its work in :class:`Stats`, and runs one forward
pass over the slots of a padded layout that its cache does not cover yet. The cache
object it returns is a value with ``length``, ``crop(n)`` and ``select_rows(idx)``;
states never look inside it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Protocol

import torch

__all__ = ["Stats", "Model", "check_layout", "causal_mask", "position_ids"]


@dataclass
class Stats:
    """Counters of the work a model did.

    Attributes
    ----------
    tokens_forwarded
        Token positions sent through the transformer blocks (prefill and decode
        together), padding and holes of a batch excluded.
    forward_calls
        Forward passes.
    positions_forwarded
        Slots sent through the blocks including padding: what a batch really costs.
    """

    tokens_forwarded: int = 0
    forward_calls: int = 0
    positions_forwarded: int = 0

    def reset(self) -> None:
        """Set every counter back to zero."""
        for f in fields(self):
            setattr(self, f.name, 0)

    def record(self, attention_mask: torch.Tensor, start: int) -> None:
        """Count one forward pass over the slots of ``attention_mask`` from ``start`` on."""
        new = attention_mask[:, start:]
        self.forward_calls += 1
        self.tokens_forwarded += int(new.sum())
        self.positions_forwarded += new.numel()

    def snapshot(self) -> dict:
        """The counters as a dict, to compare before and after an operation."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


class Model(Protocol):
    """A backend: the local transformers one or the swarm one."""

    tokenizer: Any
    stats: Stats
    vocab_size: int  # width of the logits
    max_length: int  # context length (positions)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, cache: Any,
                logits_to_keep: int = 1) -> tuple[torch.Tensor, Any]:
        """Run the slots after ``cache.length`` and return (logits of the last slots, new cache).

        ``input_ids`` is ``[rows, n]`` (the uncovered slots), ``attention_mask`` is
        ``[rows, cache_length + n]`` over the whole layout (0 marks padding and holes).
        """
        ...


def check_layout(input_ids: torch.Tensor, attention_mask: torch.Tensor, start: int) -> None:
    """The mask must cover the ``start`` cached slots and the new ones, row for row."""
    rows, n = input_ids.shape
    if attention_mask.shape != (rows, start + n):
        raise ValueError(f"attention mask {tuple(attention_mask.shape)} does not cover the cache "
                         f"({start}) and the {n} new slots of {rows} rows")


def position_ids(attention_mask: torch.Tensor, start: int) -> torch.Tensor:
    """Positions of the slots from ``start`` on: each row counts only its real tokens."""
    pos = attention_mask.long().cumsum(-1) - 1
    return pos[:, start:].clamp(min=0)


def causal_mask(attention_mask: torch.Tensor, start: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive 4D mask ``[rows, 1, n, start + n]`` of a forward over slots ``[start, start+n)``.

    A query attends to earlier real slots and to itself. Letting a padding slot see
    itself keeps every softmax row non-empty, so no NaN can leak into the cache.
    """
    rows, total = attention_mask.shape
    n = total - start
    q = torch.arange(start, total).unsqueeze(1)
    k = torch.arange(total).unsqueeze(0)
    allowed = (k <= q) & attention_mask.bool().unsqueeze(1)
    allowed = allowed | (k == q)
    mask = torch.zeros((rows, 1, n, total), dtype=dtype)
    return mask.masked_fill_(~allowed.unsqueeze(1), torch.finfo(dtype).min)
