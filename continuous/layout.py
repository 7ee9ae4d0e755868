"""Rows of token ids laid out for a batched forward, with their text and cache.

Every row of a batch lives in the same ``[rows, length]`` grid of slots. A slot whose
attention mask is 0 is padding or a *hole*: a position the row no longer uses (its
token was cut off by a slice, or the row finished while others went on). Holes may
sit anywhere, so any edit of a row keeps the cache of every other row: attention
ignores masked slots and positions count only real tokens. The cache covers the
first ``cache.length`` slots of every row.

Each row also keeps its text and, for each real token, the character offset where the
token's text ends; that is what turns character slices into token cuts.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, replace
from typing import Any, Sequence

import torch

from .engines import caches

__all__ = ["Text", "Rows", "encode", "encode_after", "retokenize", "interior_holes", "dense"]


class Text(str):
    """A ``str`` some of whose spans are plain text: there, a special token's text is
    encoded as text, never as that token's id.

    :func:`continuous.chat.prompt` returns one where a message's content holds the text
    of a special token (``<|im_end|>``...), so that a user cannot write the template's
    markers. Slicing it and adding a ``str`` to it (either side) keep the spans; any
    other operation (``str.replace``, an f-string, ``str(text)``) gives a plain ``str``,
    whose special tokens' text is encoded as those tokens.

    Attributes
    ----------
    plain : tuple[tuple[int, int], ...]
        The ``(start, end)`` character spans that are plain text, in order.
    """

    plain: tuple[tuple[int, int], ...]

    def __new__(cls, text: str, plain=()):
        self = super().__new__(cls, text)
        self.plain = tuple((a, b) for a, b in plain if a < b)
        return self

    def __getitem__(self, key):
        out = str.__getitem__(self, key)
        if not isinstance(key, slice):
            return out
        start, stop, step = key.indices(len(self))
        if step != 1:
            return str(out)
        return _text(out, [(max(a, start) - start, min(b, stop) - start) for a, b in self.plain])

    def __add__(self, other):
        if not isinstance(other, str):
            return NotImplemented
        return _text(str.__add__(self, other), self.plain + _shifted(other, len(self)))

    def __radd__(self, other):
        if not isinstance(other, str):
            return NotImplemented
        return _text(str.__add__(other, self), _shifted(other, 0) + _shifted(self, len(other)))


def _shifted(text: str, by: int) -> tuple[tuple[int, int], ...]:
    return tuple((a + by, b + by) for a, b in getattr(text, "plain", ()))


def _text(text: str, plain) -> str:
    """``text`` with these plain spans (those left empty dropped), or a plain ``str`` when none is left."""
    made = Text(text, plain)
    return made if made.plain else str(made)


def _encoded(tokenizer, text: str, prefix: bool, split: bool = False) -> tuple[list[int], list[tuple[int, int]]]:
    """Ids and character spans of ``text``'s tokens; with ``split``, special tokens' text is text."""
    options = {"split_special_tokens": True} if split else {}
    enc = tokenizer(text, add_special_tokens=prefix, return_offsets_mapping=True, **options)
    return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]


def special_prefix(tokenizer) -> str | None:
    """The text of the special prefix (BOS) the tokenizer adds to an encoded text (``None``: it adds
    none); found once per tokenizer, not once per prompt."""
    def build() -> str | None:
        prefix = tokenizer("", add_special_tokens=True)["input_ids"]
        return tokenizer.decode(prefix) if prefix else None

    return caches.derived(tokenizer, "special prefix", build)


def encode(tokenizer, text: str, special: bool) -> tuple[list[int], list[int]]:
    """Token ids of ``text`` and the character end of each token.

    With ``special``, the tokenizer adds its special prefix (BOS), which ends at character
    0, unless the text already starts with it (a chat template renders the BOS itself):
    it is then the text's own first token, not a second one. The plain spans of a
    :class:`Text` are encoded as text (see :func:`_as_text`).
    """
    if special and text:
        prefix = special_prefix(tokenizer)
        at_start = any(a == 0 for a, _ in getattr(text, "plain", ()))  # a message's text, not a rendered BOS
        special = not (prefix is not None and text.startswith(prefix) and not at_start)
    ids, offsets = _encoded(tokenizer, text, special)
    if getattr(text, "plain", ()):
        ids, offsets = _as_text(tokenizer, text, ids, offsets)
    ends, last = [], 0
    for _, end in offsets:
        last = max(last, end)  # special tokens report (0, 0)
        ends.append(last)
    # A token whose span runs past the next one's start ends no text of its own: SentencePiece's
    # dummy-prefix "▁" before a token that spells the first character again (",\"" is "▁", ",\"").
    # Cutting the text after it would keep a space the cut text does not have: it ends where
    # the next one does.
    for i in range(len(ends) - 2, -1, -1):
        if offsets[i + 1][0] < offsets[i][1]:
            ends[i] = ends[i + 1]
    return ids, ends


def _as_text(tokenizer, text: Text, ids: list[int], offsets: list[tuple[int, int]]):
    """``ids`` with every stretch between two special tokens outside ``text.plain`` that holds a
    special token inside it encoded again, special tokens' text as text.

    The tokenizer splits its input at special tokens and encodes the stretches between
    them alone, so the stretches without such a token keep their tokens: a text whose
    plain spans hold no special token's text is encoded exactly as a ``str``.
    """
    specials = {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special}
    inside = [i in specials and a < b and any(s <= a and b <= e for s, e in text.plain)
              for i, (a, b) in zip(ids, offsets)]
    if not any(inside):
        return ids, offsets
    bounds = [-1] + [k for k, i in enumerate(ids) if i in specials and not inside[k]] + [len(ids)]
    out_ids, out_offsets = [], []
    for left, right in zip(bounds, bounds[1:]):
        if left >= 0:
            out_ids.append(ids[left])
            out_offsets.append(offsets[left])
        if not any(inside[left + 1:right]):
            out_ids += ids[left + 1:right]
            out_offsets += offsets[left + 1:right]
            continue
        start = offsets[left][1] if left >= 0 else 0
        # A special token the tokenizer adds after the text (an EOS) reports (0, 0).
        end = offsets[right][0] if right < len(ids) and offsets[right] != (0, 0) else len(text)
        new_ids, new_offsets = _stretch(tokenizer, str(text), start, end)
        out_ids += new_ids
        out_offsets += new_offsets
    return out_ids, out_offsets


def _stretch(tokenizer, text: str, start: int, end: int):
    """``text[start:end]`` encoded as the tokenizer encodes a stretch after a special token, all
    of it as text; offsets in ``text``."""
    window = text[start:end]
    if start > 0:  # not at the start of the text: no dummy-prefix space (see encode_after)
        anchor, _ = _encoded(tokenizer, _ANCHOR, False)
        ids, offsets = _encoded(tokenizer, _ANCHOR + window, False, split=True)
        if ids[: len(anchor)] == anchor:
            return ids[len(anchor):], [(a + start - len(_ANCHOR), b + start - len(_ANCHOR))
                                       for a, b in offsets[len(anchor):]]
    ids, offsets = _encoded(tokenizer, window, False, split=True)
    return ids, [(a + start, b + start) for a, b in offsets]


#: Text put before a window that is encoded as the middle of a longer text (then cut off).
_ANCHOR = "\n"


def encode_after(tokenizer, text: str, start: int, end: int) -> tuple[list[int], list[int]]:
    """Token ids of ``text[start:end]`` as tokenized after ``text[:start]``, and their ends relative to ``start``.

    A SentencePiece tokenizer puts a dummy-prefix space before the text it encodes;
    that is right at the start of a text, not in its middle. After ``start > 0``, the
    window is encoded after an anchor whose own tokens are then dropped; where the anchor
    merges with the window (some tokenizer that joins them), the window is encoded alone.
    """
    window = text[start:end]
    if start == 0:
        return encode(tokenizer, window, special=False)
    anchor, _ = encode(tokenizer, _ANCHOR, special=False)
    ids, ends = encode(tokenizer, _ANCHOR + window, special=False)
    if ids[: len(anchor)] == anchor:
        return ids[len(anchor):], [e - len(_ANCHOR) for e in ends[len(anchor):]]
    return encode(tokenizer, window, special=False)


def retokenize(tokenizer, ids: Sequence[int], ends: Sequence[int], text: str, cut: int,
               suffix: str) -> tuple[int, list[int], list[int]]:
    """How a row's tokens change when its text becomes ``text[:cut] + suffix``.

    Tokens ending after ``cut`` are dropped. The rest of the new text is encoded after
    the kept tokens, except where the tokenizer merges across the boundary: then the
    last kept tokens that the merge reaches are re-encoded with it. The merge is found
    by encoding a window of the old text alone and with the new text, widening the
    window until its first token is stable. Old tokens are never re-canonicalized: a
    generated token sequence the tokenizer would have split otherwise is kept as is.

    Returns
    -------
    keep, new_ids, new_ends
        Number of leading tokens kept, and the ids and character ends of the tokens after them.
    """
    keep = bisect.bisect_right(ends, cut)
    first = 0  # the special prefix (BOS) ends at character 0 and is never re-encoded
    while first < keep and ends[first] == 0:
        first += 1
    end_kept = ends[keep - 1] if keep else 0
    rest = text[end_kept:cut] + suffix
    if not rest:
        return keep, [], []
    window = 4
    while True:
        start_tok = max(first, keep - window)
        start = ends[start_tok - 1] if start_tok > 0 else 0
        alone, _ = encode_after(tokenizer, text, start, end_kept) if end_kept > start else ([], [])
        joined, joined_ends = encode_after(tokenizer, text[:end_kept] + rest, start, end_kept + len(rest))
        same = 0
        while same < min(len(alone), len(joined)) and alone[same] == joined[same]:
            same += 1
        # A changed first token means a merge may reach further back: widen the window.
        if same > 0 or start_tok == first or not alone:
            break
        window *= 4
    merge_at = start + joined_ends[same - 1] if same else start
    if same == len(alone):  # no merge across the boundary
        return keep, joined[same:], [start + e for e in joined_ends[same:]]
    keep = bisect.bisect_right(ends, merge_at, 0, keep)
    end_kept = ends[keep - 1] if keep else 0
    if end_kept == merge_at:
        return keep, joined[same:], [start + e for e in joined_ends[same:]]
    # The old tokens do not end where the merge starts (they were not the tokenizer's
    # own split): re-encode from the last old token boundary before it.
    new_ids, new_ends = encode_after(tokenizer, text[:cut] + suffix, end_kept, cut + len(suffix))
    return keep, new_ids, [end_kept + e for e in new_ends]


def interior_holes(mask: torch.Tensor) -> bool:
    """Whether some row of a host mask has a hole between two of its real tokens (left padding is none)."""
    m = mask.bool()
    slots = torch.arange(m.shape[1])
    first = torch.where(m, slots, m.shape[1]).min(1).values
    last = torch.where(m, slots, -1).max(1).values
    count = m.sum(1)
    return bool(((last - first + 1 > count) & (count > 0)).any())


#: Holes are squeezed out of a cache once they take more than this share of its slots.
COMPACT_SHARE = 0.125


def dense(length: int, widest: int) -> bool:
    """Whether a cache of ``length`` slots whose widest row holds ``widest`` real ones keeps its
    holes (they take at most :data:`COMPACT_SHARE` of the slots)."""
    return length - widest <= COMPACT_SHARE * length


@dataclass(frozen=True, eq=False, kw_only=True)
class Rows:
    """The rows of a state: padded token grid, attention mask, cache, text and offsets.

    Attributes
    ----------
    token_ids, attention_mask
        ``[rows, length]`` LongTensors; masked slots hold ``pad``.
    cache
        The backend's cache covering slots ``[0, cache.length)``, or ``None``.
    texts
        Each row's text.
    ends
        For each row, the character end of each real token, in order.
    logits, logits_ok
        ``[rows, vocab]`` logits after each row's last real token, valid where
        ``logits_ok``: what lets a finished row be continued without recomputing it.
    pad
        The id written in masked slots.
    """

    token_ids: torch.Tensor
    attention_mask: torch.Tensor
    cache: Any
    texts: tuple[str, ...]
    ends: tuple[tuple[int, ...], ...]
    logits: torch.Tensor | None
    logits_ok: tuple[bool, ...]
    pad: int

    @classmethod
    def from_texts(cls, tokenizer, texts: Sequence[str]) -> "Rows":
        """Encode prompts (with the tokenizer's special prefix), left-padded."""
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
        encoded = [encode(tokenizer, t, special=True) for t in texts]
        width = max(len(ids) for ids, _ in encoded)
        # Made whole from lists: one tensor each, not a write per row (a call's start pays them).
        token_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids, _ in encoded], dtype=torch.long)
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids, _ in encoded], dtype=torch.long)
        return cls(token_ids=token_ids, attention_mask=mask, cache=None, texts=tuple(texts),
                   ends=tuple(tuple(e) for _, e in encoded), logits=None, logits_ok=(False,) * len(texts), pad=pad)

    @property
    def n_rows(self) -> int:
        return self.token_ids.shape[0]

    @property
    def cache_length(self) -> int:
        return self.cache.length if self.cache is not None else 0

    def real_ids(self, row: int) -> list[int]:
        """The row's token ids without padding and holes."""
        return self.token_ids[row][self.attention_mask[row].bool()].tolist()

    def cached_lengths(self) -> torch.Tensor:
        """Per row, how many real tokens the cache covers."""
        return self.attention_mask[:, : self.cache_length].sum(1)

    def drop_cache(self) -> "Rows":
        return replace(self, cache=None, logits=None, logits_ok=(False,) * self.n_rows)

    def select(self, rows: Sequence[int]) -> "Rows":
        """The given rows, in that order (indices may repeat). Caches are kept, holes squeezed out."""
        idx = torch.as_tensor(list(rows), dtype=torch.long)
        if self._compactable and not torch.equal(idx, torch.arange(self.n_rows)):
            return self._gathered(idx, force=True)  # the rows are copied anyway: squeeze holes on the way
        cache = self.cache.select_rows(idx) if self.cache is not None else None
        out = Rows(
            token_ids=self.token_ids[idx], attention_mask=self.attention_mask[idx], cache=cache,
            texts=tuple(self.texts[i] for i in rows), ends=tuple(self.ends[i] for i in rows),
            logits=self.logits[idx.to(self.logits.device)] if self.logits is not None else None,
            logits_ok=tuple(self.logits_ok[i] for i in rows), pad=self.pad,
        )
        return out.edit([(len(e), [], [], t) for e, t in zip(out.ends, out.texts)])

    def compact(self) -> "Rows":
        """The same rows with the holes of the cached slots squeezed out, when they waste room.

        Each row's cached tokens move right-aligned into the fewest slots; uncached slots
        follow unchanged. Memory and attention then follow real tokens, not history.
        """
        length = self.cache_length
        if length == 0 or not self._compactable:
            return self
        widest = int(self.attention_mask[:, :length].sum(1).max())
        if dense(length, widest):
            return self
        return self._gathered(None)

    @property
    def _compactable(self) -> bool:
        return self.cache is not None and self.cache.movable

    def _gathered(self, rows: torch.Tensor | None, force: bool = False) -> "Rows":
        """Rows ``rows`` (all when ``None``), each row's cached tokens right-aligned, cache copied."""
        idx = torch.arange(self.n_rows) if rows is None else rows
        length = self.cache_length
        cached = self.attention_mask[idx, :length].bool()
        counts = cached.sum(1)
        width = int(counts.max()) if len(idx) else 0
        if not force and width == length:
            return self
        slots = torch.zeros((len(idx), width), dtype=torch.long)
        token_ids = torch.full((len(idx), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for i, r in enumerate(idx.tolist()):
            real = cached[i].nonzero().flatten()
            k = real.numel()
            slots[i, width - k:] = real
            token_ids[i, width - k:] = self.token_ids[r, real]
            mask[i, width - k:] = 1
        cache = self.cache.gather_rows_slots(idx, slots) if width else None
        rest = slice(length, None)
        picked = [int(r) for r in idx]
        out = Rows(
            token_ids=torch.cat([token_ids, self.token_ids[idx, rest]], 1),
            attention_mask=torch.cat([mask, self.attention_mask[idx, rest]], 1),
            cache=cache, texts=tuple(self.texts[r] for r in picked), ends=tuple(self.ends[r] for r in picked),
            logits=self.logits[idx.to(self.logits.device)] if self.logits is not None else None,
            logits_ok=tuple(self.logits_ok[r] for r in picked), pad=self.pad,
        )
        return out.edit([(len(e), [], [], t) for e, t in zip(out.ends, out.texts)])

    def edit(self, edits: Sequence[tuple[int, list[int], list[int], str]]) -> "Rows":
        """Cut and extend rows.

        Parameters
        ----------
        edits
            Per row ``(keep, new_ids, new_ends, text)``: keep the first ``keep`` real
            tokens, then append ``new_ids`` (with their character ends); ``text`` is the
            row's new text. Slots after a row's last kept token become holes; trailing
            slots no row uses are removed, and the cache is cropped to what remains.
        """
        mask = self.attention_mask
        last = []
        for r, (keep, *_rest) in enumerate(edits):
            slots = mask[r].nonzero().flatten()
            last.append(int(slots[keep - 1]) + 1 if keep > 0 else 0)
        width = max(last) if last else 0
        token_ids = self.token_ids[:, :width].clone()
        mask = mask[:, :width].clone()
        for r, end in enumerate(last):
            token_ids[r, end:] = self.pad
            mask[r, end:] = 0
        n_new = max((len(e[1]) for e in edits), default=0)
        if n_new:
            chunk = torch.full((self.n_rows, n_new), self.pad, dtype=torch.long)
            chunk_mask = torch.zeros((self.n_rows, n_new), dtype=torch.long)
            for r, (_, ids, _, _) in enumerate(edits):
                if ids:  # right-aligned: every row's last slot is its newest token
                    chunk[r, n_new - len(ids):] = torch.tensor(ids, dtype=torch.long)
                    chunk_mask[r, n_new - len(ids):] = 1
            token_ids = torch.cat([token_ids, chunk], 1)
            mask = torch.cat([mask, chunk_mask], 1)
        cache = self.cache.crop(width) if self.cache is not None and width < self.cache.length else self.cache
        ends = tuple(tuple(self.ends[r][:keep]) + tuple(new_ends)
                     for r, (keep, _, new_ends, _) in enumerate(edits))
        ok = tuple(self.logits_ok[r] and keep == len(self.ends[r]) and not ids
                   for r, (keep, ids, _, _) in enumerate(edits))
        return Rows(token_ids=token_ids, attention_mask=mask, cache=cache, texts=tuple(e[3] for e in edits), ends=ends,
                    logits=self.logits, logits_ok=ok, pad=self.pad)

    def with_text(self, tokenizer, cuts: Sequence[int], suffixes: Sequence[str]) -> "Rows":
        """Each row's text becomes ``text[:cut] + suffix``, re-encoding only around the boundary."""
        edits = []
        for r, (cut, suffix) in enumerate(zip(cuts, suffixes)):
            text = self.texts[r]
            keep, ids, ends = retokenize(tokenizer, self.real_ids(r), self.ends[r], text, cut, suffix)
            edits.append((keep, ids, ends, text[:cut] + suffix))
        return self.edit(edits)
