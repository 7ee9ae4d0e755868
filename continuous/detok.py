"""Incremental detokenization on tokenizers' ``DecodeStream``.

A token may hold part of a character (byte-fallback SentencePiece, byte-level BPE):
its text is held back until a later token completes the character. The stream is
primed with the row's last tokens, so spacing rules that depend on the previous token
(SentencePiece's leading space) come out as a whole-text decode gives them.
"""

from __future__ import annotations

from typing import Sequence

from tokenizers.decoders import DecodeStream

__all__ = ["Detokenizer", "dangling"]

#: Context tokens given to the stream: enough for any spacing rule, and for a character
#: whose bytes are spread over the last tokens (4 bytes at most).
_CONTEXT = 8


def _backend(tokenizer):
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    if backend is None:
        raise TypeError("continuous needs a fast (Rust) tokenizer")
    return backend


class Detokenizer:
    """The text each new token adds to a row, after its ``context`` tokens.

    Parameters
    ----------
    tokenizer
        A fast HF tokenizer.
    context
        The row's tokens so far (only the last few are read).
    """

    def __init__(self, tokenizer, context: Sequence[int]):
        self.tokenizer = tokenizer
        self.backend = _backend(tokenizer)
        self.ids = list(context[-_CONTEXT:])  # context, then every token stepped
        self.pending = 0  # stepped tokens whose text is not out yet
        self.stream = DecodeStream(ids=self.ids, skip_special_tokens=False)

    def step(self, token_id: int) -> str | None:
        """The text the token adds, or ``None`` while it ends inside a character."""
        self.ids.append(token_id)
        piece = self.stream.step(self.backend, token_id)
        self.pending = 0 if piece is not None else self.pending + 1
        return piece

    def flush(self) -> str:
        """The held-back bytes as a whole-text decode shows them (replacement characters)."""
        if not self.pending:
            return ""
        held = self.ids[-self.pending:]
        before = self.ids[: -self.pending]
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=False,  # noqa: E731
                                                   clean_up_tokenization_spaces=False)
        whole, head = decode(before + held), decode(before)
        self.pending = 0
        self.stream = DecodeStream(ids=self.ids[-_CONTEXT:], skip_special_tokens=False)
        return whole[len(head):] if whole.startswith(head) else decode(held)

    def copy(self) -> "Detokenizer":
        """An independent detokenizer at the same point."""
        new = Detokenizer.__new__(Detokenizer)
        new.tokenizer, new.backend, new.ids, new.pending = self.tokenizer, self.backend, list(self.ids), self.pending
        start = len(new.ids) - new.pending
        new.stream = DecodeStream(ids=new.ids[max(0, start - _CONTEXT):start], skip_special_tokens=False)
        for t in new.ids[start:]:
            new.stream.step(new.backend, t)
        return new


def dangling(tokenizer, context: Sequence[int]) -> int:
    """How many last tokens of ``context`` end inside a character (their text is not out yet)."""
    ids = list(context[-2 * _CONTEXT:])
    split = max(0, len(ids) - _CONTEXT)
    stream = DecodeStream(ids=ids[:split], skip_special_tokens=False)
    backend = _backend(tokenizer)
    held = 0
    for t in ids[split:]:
        held = 0 if stream.step(backend, t) is not None else held + 1
    return held
