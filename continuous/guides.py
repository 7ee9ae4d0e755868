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
from outlines_core import Index, Vocabulary

__all__ = ["vocabulary", "build_index"]

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
