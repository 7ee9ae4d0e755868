"""Regex constraints on ``outlines_core``: indexes cached in memory, one Guide per row, bitmasks.

The vocabulary conversion is cached per tokenizer and each ``Index`` per (regex,
vocabulary), so building the same generator twice costs a dictionary look-up. Masks
are written by outlines_core's Rust ``write_mask_into`` kernel into one int32 bitmask
row per sequence, then unpacked with a few vectorized torch ops (no ``torch.compile``,
whose first call would cost seconds on a CPU).
"""

from __future__ import annotations

import copy
import threading
import weakref

import torch
from outlines_core import Guide, Index, Vocabulary
from outlines_core.kernels.torch import fill_next_token_bitmask

__all__ = ["vocabulary", "build_index", "RowGuides"]

_LOCK = threading.Lock()
_VOCABS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_INDEXES: dict = {}
_BITS = 1 << torch.arange(32, dtype=torch.int64)


def vocabulary(tokenizer) -> Vocabulary:
    """The outlines_core ``Vocabulary`` of a HF tokenizer, built once per tokenizer."""
    with _LOCK:
        vocab = _VOCABS.get(tokenizer)
    if vocab is None:
        from outlines.backends.outlines_core import OutlinesCoreBackend
        from outlines.models.transformers import TransformerTokenizer

        if tokenizer.eos_token_id is None:
            raise ValueError("constrained generation needs a tokenizer with an EOS token")
        # TransformerTokenizer sets a pad token on the tokenizer it wraps; give it a copy.
        adapter = TransformerTokenizer(copy.copy(tokenizer))
        vocab = OutlinesCoreBackend.create_outlines_core_vocabulary(
            adapter.get_vocab(), adapter.eos_token_id, adapter.eos_token, adapter.convert_token_to_string
        )
        with _LOCK:
            _VOCABS[tokenizer] = vocab
    return vocab


def build_index(regex: str, tokenizer) -> Index:
    """The ``Index`` of a regex over a tokenizer's vocabulary, cached in memory.

    Raises
    ------
    ValueError
        When the regex is invalid or no token sequence can match it.
    """
    vocab = vocabulary(tokenizer)
    key = (regex, id(vocab))
    with _LOCK:
        index = _INDEXES.get(key)
    if index is None:
        try:
            index = Index(regex, vocab)
        except Exception as exc:  # outlines_core raises plain ValueError/RuntimeError
            raise ValueError(f"cannot build a constraint from regex {regex!r}: {exc}") from exc
        with _LOCK:
            _INDEXES[key] = (index, vocab)  # keep vocab alive so its id is not reused
    else:
        index = index[0]
    return index


class RowGuides:
    """One outlines_core ``Guide`` per row, and the masks of what each row may emit next.

    Parameters
    ----------
    index
        The compiled constraint, or ``None`` for free text.
    rows
        Number of rows.
    vocab_size
        Width of the logits (may exceed the tokenizer's size; extra ids are never allowed).
    n_tokens
        Size of the tokenizer's vocabulary.
    eos_token_id
        The EOS id, allowed when a guide accepts or for free text.
    """

    def __init__(self, index: Index | None, rows: int, vocab_size: int, n_tokens: int,
                 eos_token_id: int | None):
        self.index = index
        self.vocab_size = vocab_size
        self.eos = eos_token_id
        self.guides = [Guide(index) for _ in range(rows)] if index is not None else None
        self.bitmask = torch.zeros((rows, (vocab_size + 31) // 32), dtype=torch.int32)
        # Free text may emit any real token; ids past the tokenizer (padded embeddings) never.
        self.free = torch.zeros(vocab_size, dtype=torch.bool)
        self.free[: min(n_tokens, vocab_size)] = True

    def allowed(self, rows: list[int]) -> torch.Tensor:
        """Boolean ``[len(rows), vocab_size]`` of the tokens each given row may emit next."""
        if self.guides is None:
            return self.free.expand(len(rows), -1)
        for i in rows:
            fill_next_token_bitmask(self.guides[i], self.bitmask[i : i + 1])
        words = self.bitmask[rows].to(torch.int64) & 0xFFFFFFFF
        bits = (words.unsqueeze(-1) & _BITS) != 0
        return bits.view(len(rows), -1)[:, : self.vocab_size] & self.free

    def advance(self, row: int, token_id: int) -> None:
        """Move a row's guide past a token it emitted."""
        if self.guides is not None:
            self.guides[row].advance(token_id, return_tokens=False)

    def select(self, rows: list[int]) -> None:
        """Reorder (and duplicate) rows in place, for beams and forks."""
        if self.guides is not None:
            self.guides = [copy.copy(self.guides[i]) for i in rows]
        self.bitmask = self.bitmask[rows].contiguous()
