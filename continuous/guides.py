"""Regex constraints on ``outlines_core``, and the per-row masks the decoding loop applies.

The vocabulary conversion is cached per tokenizer and each ``Index`` per (regex,
vocabulary) in a bounded LRU, so building the same generator twice costs a dictionary
look-up. Matchers write one packed int32 bitmask row per sequence on the host (the
engines' Rust kernels); :class:`RowMasks` copies it to the model's device and unpacks it
there with a few vectorized torch ops.
"""

from __future__ import annotations

import copy
import threading
import weakref
from collections import OrderedDict

import torch
from outlines_core import Guide, Index, Vocabulary

__all__ = ["vocabulary", "build_index", "IndexConstraint", "RowMasks"]

_LOCK = threading.Lock()
_VOCABS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_INDEXES: "OrderedDict" = OrderedDict()  # (regex, vocabulary id) -> (Index, Vocabulary), least recent first
#: Indexes kept in memory; a JSON schema's can take megabytes, so the cache is bounded.
MAX_INDEXES = 64


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
        entry = _INDEXES.get(key)
        if entry is not None:
            _INDEXES.move_to_end(key)
            return entry[0]
    try:
        index = Index(regex, vocab)
    except Exception as exc:  # outlines_core raises plain ValueError/RuntimeError
        raise ValueError(f"cannot build a constraint from regex {regex!r}: {exc}") from exc
    with _LOCK:
        _INDEXES[key] = (index, vocab)  # keep vocab alive so its id is not reused
        while len(_INDEXES) > MAX_INDEXES:
            _INDEXES.popitem(last=False)
    return index


class _GuideMatcher:
    """A :class:`~continuous.engines.Matcher` on an outlines_core ``Guide``."""

    __slots__ = ("guide", "index", "eos")

    def __init__(self, guide: Guide, index: Index, eos: int):
        self.guide, self.index, self.eos = guide, index, eos

    def fill(self, bitmask: torch.Tensor) -> None:
        self.guide.write_mask_into(bitmask.data_ptr(), bitmask.numel(), bitmask.element_size())

    def advance(self, token_id: int) -> None:
        self.guide.advance(token_id, return_tokens=False)

    def rollback(self, n: int) -> None:
        self.guide.rollback_state(n)

    def forced(self) -> list[int]:
        allowed = self.index.get_allowed_tokens(self.guide.get_state())
        return allowed if len(allowed) == 1 and allowed[0] != self.eos else []

    def accepting(self) -> bool:
        return self.guide.is_finished()

    def done(self) -> bool:
        return self.guide.get_tokens() == [self.eos]

    def copy(self) -> "_GuideMatcher":
        return _GuideMatcher(copy.copy(self.guide), self.index, self.eos)


class IndexConstraint:
    """A :class:`~continuous.engines.Constraint` on an outlines_core ``Index``."""

    engine = "outlines_core"

    def __init__(self, index: Index, eos_token_id: int):
        self.index, self.eos = index, eos_token_id

    def matcher(self) -> _GuideMatcher:
        return _GuideMatcher(Guide(self.index), self.index, self.eos)


class RowMasks:
    """Per row, the constraint's matcher, and the masks of what each row may emit next, on a device.

    Matchers write a packed int32 bitmask on the host (a few KB per row even for 128k
    vocabularies) as soon as a row moves; it is copied to the device and unpacked there,
    so logits never leave it. A bitmask row with a single bit says that the constraint
    allows one token only: EOS (the row is done) or a forced token (fast-forward), which
    is by construction the token decoding one by one would choose.

    Parameters
    ----------
    constraint
        A :class:`~continuous.engines.Constraint`, or ``None`` for free text.
    matchers
        One matcher per row instead of the constraint's (healing wraps them).
    rows
        Number of rows.
    vocab_size
        Width of the logits (may exceed the tokenizer's size; extra ids are never allowed).
    n_tokens
        Size of the tokenizer's vocabulary.
    eos
        The EOS id.
    device
        Where the logits are.
    """

    def __init__(self, constraint, rows: int, vocab_size: int, n_tokens: int, eos: int | None,
                 device: torch.device, matchers: list | None = None):
        if matchers is None and constraint is not None:
            matchers = [constraint.matcher() for _ in range(rows)]
        self.matchers = matchers
        self.vocab_size, self.eos, self.device = vocab_size, eos, device
        words = (vocab_size + 31) // 32
        self.bitmask = torch.zeros((rows, words), dtype=torch.int32, pin_memory=device.type == "cuda")
        self.single: list[int | None] = [None] * rows  # the one allowed token of a row, if one
        # Free text may emit any real token; ids past the tokenizer (padded embeddings) never.
        self.free = None
        if n_tokens < vocab_size:
            self.free = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            self.free[:n_tokens] = True
        self.bits = torch.tensor([1 << i for i in range(31)] + [-(1 << 31)], dtype=torch.int32, device=device)
        if self.matchers is not None:
            for r in range(rows):
                self._refresh(r)

    def _refresh(self, row: int) -> None:
        words = self.bitmask[row]
        self.matchers[row].fill(words)
        nonzero = words.nonzero()
        single = None
        if nonzero.shape[0] == 1:
            at = int(nonzero[0, 0])
            word = int(words[at]) & 0xFFFFFFFF
            if word & (word - 1) == 0:
                single = at * 32 + word.bit_length() - 1
        self.single[row] = single

    def allowed(self) -> torch.Tensor | None:
        """Boolean ``[rows, vocab_size]`` on the device, or ``None`` when every token is allowed."""
        if self.matchers is None:
            return self.free
        words = self.bitmask.to(self.device, non_blocking=True)
        allowed = (words.unsqueeze(-1) & self.bits) != 0
        allowed = allowed.view(words.shape[0], -1)[:, : self.vocab_size]
        return allowed if self.free is None else allowed & self.free

    def advance(self, row: int, token_id: int) -> None:
        """Move a row's matcher past a token it emitted."""
        if self.matchers is not None:
            self.matchers[row].advance(token_id)
            self._refresh(row)

    def rollback(self, row: int, n: int) -> None:
        """Undo a row's last ``n`` tokens."""
        if self.matchers is not None and n:
            self.matchers[row].rollback(n)
            self._refresh(row)

    def forced(self, row: int) -> list[int]:
        """The token a row's constraint forces next (empty when it has a choice)."""
        single = self.single[row]
        return [single] if single is not None and single != self.eos else []

    def done(self, row: int) -> bool:
        """Whether nothing but EOS may follow in this row."""
        return self.matchers is not None and self.single[row] == self.eos

    def select(self, rows: list[int]) -> None:
        """Reorder (and duplicate) rows in place, for beams and forks."""
        if self.matchers is not None:
            seen = set()
            picked = []
            for i in rows:  # the first use of a matcher takes it, repeats copy it
                picked.append(self.matchers[i] if i not in seen else self.matchers[i].copy())
                seen.add(i)
            self.matchers = picked
        self.single = [self.single[i] for i in rows]
        self.bitmask = self.bitmask[rows].contiguous()
        if self.device.type == "cuda":
            self.bitmask = self.bitmask.pin_memory()
