"""Incremental detokenization: the text each new token adds, built on tokenizers' DecodeStream.

The invariant (tests/test_detok.py): the pieces of a row, once flushed, concatenate to
``decode(context + ids)`` minus ``decode(context)``, even when a token splits a
multi-byte character (byte-fallback vocabularies) or when the tokenizer's decoder
treats the first token of a sequence differently (SentencePiece strips its space).
"""

from __future__ import annotations

import copy as _copy
from typing import Sequence

from tokenizers.decoders import DecodeStream

from .engines import caches

__all__ = ["Detokenizer", "backend_of", "dangling"]

# Tokens of context the stream is primed with. A few are enough for every decoder we
# know (SentencePiece's leading space, byte fallback's 4-byte characters), and a short
# prefix keeps each step's decode short however long the text is.
_CONTEXT = 8


def backend_of(tokenizer):
    """The ``tokenizers.Tokenizer`` behind a transformers tokenizer (or the object itself).

    Raises
    ------
    TypeError
        When the tokenizer has no tokenizers backend (a "slow" Python tokenizer).
    """
    backend = getattr(tokenizer, "_tokenizer", tokenizer)
    if not hasattr(backend, "decode_batch"):
        raise TypeError(f"{type(tokenizer).__name__} has no `tokenizers` backend (`_tokenizer`): "
                        "load the model's fast tokenizer (use_fast=True)")
    return backend


def _byte_tokens(backend) -> frozenset[int]:
    """The ids of a byte-fallback vocabulary's ``<0xXX>`` tokens (none for byte-level BPE)."""
    def find():
        found = (backend.token_to_id(f"<0x{b:02X}>") for b in range(256))
        return frozenset(i for i in found if i is not None)

    return caches.derived(backend, "byte tokens", find)


class Detokenizer:
    """The text that each new token of one row adds.

    Parameters
    ----------
    tokenizer
        A transformers tokenizer with a fast backend, or a ``tokenizers.Tokenizer``.
    context_ids
        The row's ids before the first new token: they decide how the first new token
        decodes (a SentencePiece word's space, the rest of a split character).

    Attributes
    ----------
    replaced
        After a piece, how many characters at the end of the text before it the piece
        replaces (almost always 0). It is not 0 when the text before ended inside a
        character, flushed as replacement characters (a call cut it, e.g. by
        ``max_tokens``), that this piece completes, or when a byte-fallback decoder
        rewrites a run of bytes; the caller drops those characters, so that the text
        stays the decode of the ids.
    """

    def __init__(self, tokenizer, context_ids: Sequence[int]):
        self._backend = backend_of(tokenizer)
        self._bytes = _byte_tokens(self._backend)
        self._done = self._window([int(i) for i in context_ids])  # ids whose text was given out
        self._pending: list[int] = []  # ids since the last piece (an incomplete character)
        self.replaced = 0
        self._stream = self._new_stream()

    def _window(self, ids: list[int]) -> list[int]:
        # The last few ids, and the whole run of byte tokens the first of them is in:
        # a byte-fallback decoder may rewrite all of a run (see step).
        start = max(0, len(ids) - _CONTEXT)
        while 0 < start < len(ids) and ids[start] in self._bytes and ids[start - 1] in self._bytes:
            start -= 1
        return ids[start:]

    def _new_stream(self) -> DecodeStream | None:
        # A stream primed with text that ends inside a character gives out the primed
        # text again once the character is completed (or replaced): decode by hand
        # until the next piece.
        if self._decode(self._done).endswith("\ufffd"):
            return None
        return DecodeStream(ids=self._done, skip_special_tokens=False)

    def _decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=False)

    def step(self, token_id: int) -> str | None:
        """Add a token.

        Returns
        -------
        str or None
            The text the token adds (with any held-back tokens before it), or ``None``
            while the text ends inside a character; :meth:`flush` gives that text.
        """
        token_id = int(token_id)
        self._pending.append(token_id)
        self.replaced = 0
        if self._is_byte(token_id):
            # A byte-fallback decoder decodes a run of byte tokens together, and writes
            # the whole run as replacement characters when it is not valid UTF-8: a
            # byte may still change the text of the bytes before it, so hold the run.
            return None
        if len(self._pending) > 1 or self._stream is None:
            return self._emit(force=False)
        try:
            piece = self._stream.step(self._backend, token_id)
        except Exception:
            # The decode no longer extends the primed text (e.g. the context ended
            # inside a character that this token completes): hand out what is new.
            return self._emit(force=False)
        if piece is not None:
            self._advance()
        return piece

    def flush(self) -> str:
        """The text of the held-back tokens, incomplete bytes as replacement characters.

        Like a piece of :meth:`step`, it may replace :attr:`replaced` characters.
        """
        return self._emit(force=True) or ""

    def copy(self) -> "Detokenizer":
        """An independent copy (for rows that fork or beams that reorder)."""
        new = Detokenizer.__new__(Detokenizer)
        new._backend = self._backend
        new._bytes = self._bytes
        new._done = list(self._done)
        new._pending = list(self._pending)
        new.replaced = self.replaced
        new._stream = _copy.copy(self._stream) if self._stream is not None else None
        return new

    def _is_byte(self, token_id: int) -> bool:
        return token_id in self._bytes

    def _emit(self, force: bool) -> str | None:
        self.replaced = 0
        if not self._pending:
            return ""
        before = self._decode(self._done)
        now = self._decode(self._done + self._pending)
        if now.endswith("\ufffd") and not force:
            return None
        # The common prefix, not ``before``, is what stays: a decoder may rewrite the
        # end of the old text (a completed character), and text already given out
        # cannot be taken back.
        keep = 0
        while keep < min(len(before), len(now)) and before[keep] == now[keep]:
            keep += 1
        piece = now[keep:]
        self.replaced = len(before) - keep
        self._advance()
        self._stream = self._new_stream()
        return piece

    def _advance(self) -> None:
        self._done = self._window(self._done + self._pending)
        self._pending = []


def dangling(tokenizer, context: Sequence[int]) -> int:
    """How many last tokens of ``context`` end inside a character (their text is not whole yet).

    A call that stopped there flushed them as replacement characters; the next call
    decodes them again with the tokens that complete the character. A context whose text
    is whole (a prompt that ends with a byte-fallback token such as ``"\n"``) has none.
    """
    ids = [int(i) for i in context]
    tail = ids[-_DANGLING:]
    if not backend_of(tokenizer).decode(tail, skip_special_tokens=False).endswith("\ufffd"):
        return 0
    detok = Detokenizer(tokenizer, ids[-_DANGLING - _CONTEXT:-_DANGLING] if len(ids) > _DANGLING else [])
    held = 0
    for t in tail:
        held = 0 if detok.step(t) is not None else held + 1
    return held


#: The longest run of held-back tokens looked for (a byte-fallback run is a few tokens per character).
_DANGLING = 64
