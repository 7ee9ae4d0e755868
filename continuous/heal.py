"""Token healing: back up over a prompt's last tokens and let the model re-spell them.

A prompt that ends mid-word or mid-URL ends with a token the model rarely saw there
(``"https://www.exa"`` ends with ``"a"``, where the model would have used ``"example"``).
Healing crops the last tokens whose text some longer token could extend (a crop keeps
the cache) and constrains the first generated tokens to spell that text again, so the
model may choose the token a whole-text tokenization would have used. After the removed
text, the generator's own constraint (if any) takes over.

How many tokens: the most (up to :data:`MAX_HEAL`) whose joined text is a proper prefix
of some token's text; none when no token extends the last one.
"""

from __future__ import annotations

import bisect
import copy

import torch

from .engines import bits, caches

__all__ = ["MAX_HEAL", "TokenStrings", "token_strings", "heal_length", "HealMatcher", "healed_lengths", "heal_rows",
           "heal_matchers"]

#: The most tokens healing backs up over.
MAX_HEAL = 3

class TokenStrings:
    """Each token's text, sorted for prefix queries. Build it with :func:`token_strings`."""

    def __init__(self, tokenizer):
        from outlines.models.transformers import TransformerTokenizer

        adapter = TransformerTokenizer(copy.copy(tokenizer))  # it sets a pad token on what it wraps
        special = set(tokenizer.all_special_ids)
        texts = {}
        for token, i in adapter.get_vocab().items():
            text = adapter.convert_token_to_string(token)
            # Special tokens and byte pieces of a character cannot spell text.
            if i not in special and text and "\ufffd" not in text:
                texts[i] = text
        self.text = texts
        self.sorted = sorted((t, i) for i, t in texts.items())
        self.keys = [t for t, _ in self.sorted]
        self.by_text: dict[str, list[int]] = {}
        for t, i in self.sorted:
            self.by_text.setdefault(t, []).append(i)

    def starting_with(self, prefix: str) -> list[int]:
        """Ids of the tokens whose text starts with ``prefix``."""
        lo = bisect.bisect_left(self.keys, prefix)
        hi = bisect.bisect_left(self.keys, prefix + "\U0010ffff")
        return [i for _, i in self.sorted[lo:hi]]

    def extends(self, prefix: str) -> bool:
        """Whether some token's text is longer than ``prefix`` and starts with it."""
        lo = bisect.bisect_right(self.keys, prefix)
        return lo < len(self.keys) and self.keys[lo].startswith(prefix)


def token_strings(tokenizer) -> TokenStrings:
    """The :class:`TokenStrings` of a tokenizer, built once while it lives."""
    return caches.derived(tokenizer, "token strings", lambda: TokenStrings(tokenizer))


def heal_length(strings: TokenStrings, text: str, ends: list[int], first: int) -> int:
    """How many last tokens to back up over (0: none), given the character end of each token.

    Tokens before ``first`` (the special prefix) are never removed, nor a row's only token:
    a row needs one to generate from.
    """
    best = 0
    for k in range(1, MAX_HEAL + 1):
        if len(ends) - k < max(first, 1):
            break
        start = ends[-k - 1] if len(ends) > k else 0
        if strings.extends(text[start:]):
            best = k
    return best


class HealMatcher:
    """A :class:`~continuous.engines.Matcher`: first the removed text, then the inner constraint.

    The first token must spell all of the removed text and may run past it (that is the
    point of healing), and it must be canonical: encoding the kept text's last tokens
    followed by its text gives those tokens and then it, as a whole-text tokenization
    would. With a constraint, what it spells past the removed text must be one token the
    constraint allows there; the constraint advances by that token. Where no token
    qualifies (a removed text no single token starts), the removed text is spelled again
    token by token and the constraint starts right after it.

    Parameters
    ----------
    removed
        The text to spell again.
    inner
        The generator's constraint matcher, or ``None`` for free text.
    strings
        The tokenizer's :class:`TokenStrings`.
    tokenizer, n_tokens, eos
        The tokenizer, its size and EOS id.
    window
        The kept text's last few tokens' text, to check that the first token is canonical.
    """

    def __init__(self, removed: str, inner, strings: TokenStrings, tokenizer, n_tokens: int, eos: int | None,
                 window: str):
        self.remaining, self.inner, self.strings = removed, inner, strings
        self.n_tokens, self.eos = n_tokens, eos
        self.history: list[tuple[str, int | None] | None] = []  # per token: (remaining before, inner token)
        self.first = self._first_tokens(removed, tokenizer, window) if removed else {}

    def _first_tokens(self, removed: str, tokenizer, window: str) -> dict[int, int | None]:
        """The allowed first tokens, each with the inner constraint's token it also spells (or ``None``)."""
        inner_allows = None
        if self.inner is not None:
            inner_allows = torch.zeros(bits.words(self.n_tokens) + 1, dtype=torch.int32)
            self.inner.fill(inner_allows)
        first: dict[int, int | None] = {}
        for t in self.strings.starting_with(removed):
            rest = self.strings.text[t][len(removed):]
            if not rest:
                first[t] = None
            elif self.inner is None:
                first[t] = None
            else:
                for u in self.strings.by_text.get(rest, ()):
                    if bits.has(inner_allows, u):
                        first[t] = u
                        break
        if first:
            # Canonical: the window's own encoding, then the token (both encoded the same way,
            # so a tokenizer's prefix space does not matter).
            ids = list(first)
            before = tokenizer(window, add_special_tokens=False).input_ids if window else []
            encoded = tokenizer([window + self.strings.text[t] for t in ids], add_special_tokens=False).input_ids
            canonical = {t: first[t] for t, enc in zip(ids, encoded) if enc == before + [t]}
            first = canonical or first
        return first

    def fill(self, bitmask: torch.Tensor) -> None:
        if not self.history and self.first:
            bits.pack(self.first, bitmask, self.n_tokens)
        elif self.remaining:
            ids = [i for k in range(1, len(self.remaining) + 1) for i in self.strings.by_text.get(self.remaining[:k], ())]
            bits.pack(ids, bitmask, self.n_tokens)
        elif self.inner is not None:
            self.inner.fill(bitmask)
        else:
            bits.pack(None, bitmask, self.n_tokens)

    def advance(self, token_id: int) -> None:
        if not self.remaining:
            self.history.append(None)
            if self.inner is not None:
                self.inner.advance(token_id)
            return
        inner_token = None
        if not self.history and self.first:
            if token_id not in self.first:
                raise ValueError(f"token {token_id} does not start with the healed text {self.remaining!r}")
            inner_token = self.first[token_id]
            rest = ""
        else:
            text = self.strings.text.get(token_id, "")
            if not text or not self.remaining.startswith(text):
                raise ValueError(f"token {token_id} ({text!r}) does not spell the healed text {self.remaining!r}")
            rest = self.remaining[len(text):]
        self.history.append((self.remaining, inner_token))
        self.remaining = rest
        if inner_token is not None:
            self.inner.advance(inner_token)

    def rollback(self, n: int) -> None:
        for _ in range(n):
            entry = self.history.pop()
            if entry is None or entry[1] is not None:
                if self.inner is not None:
                    self.inner.rollback(1)
            if entry is not None:
                self.remaining = entry[0]

    def forced(self) -> list[int]:
        return [] if self.remaining or self.inner is None else self.inner.forced()

    def accepting(self) -> bool:
        return not self.remaining and (self.inner is None or self.inner.accepting())

    def done(self) -> bool:
        return not self.remaining and self.inner is not None and self.inner.done()

    def copy(self) -> "HealMatcher":
        new = copy.copy(self)
        new.history = list(self.history)
        new.inner = self.inner.copy() if self.inner is not None else None
        return new


def healed_lengths(tokenizer, rows) -> list[int]:
    """Per row, how many of its tokens healing keeps (all of them where it heals nothing)."""
    strings = token_strings(tokenizer)
    kept = []
    for text, ends in zip(rows.texts, rows.ends):
        first = next((i for i, e in enumerate(ends) if e > 0), len(ends))  # the special prefix stays
        kept.append(len(ends) - heal_length(strings, text, list(ends), first))
    return kept


def heal_rows(tokenizer, rows):
    """Crop each row's last tokens that a longer token could extend.

    Parameters
    ----------
    tokenizer
        The rows' tokenizer.
    rows
        A :class:`~continuous.layout.Rows`.

    Returns
    -------
    rows, removed
        The cropped rows (their cache kept up to the cut), and per row the removed text.
    """
    cuts, removed = [], []
    for text, ends, keep in zip(rows.texts, rows.ends, healed_lengths(tokenizer, rows)):
        cut = ends[keep - 1] if keep < len(ends) else len(text)  # a row keeps at least one token
        cuts.append(cut)
        removed.append(text[cut:])
    if not any(removed):
        return rows, removed
    return rows.with_text(tokenizer, cuts, [""] * rows.n_rows), removed


def heal_matchers(tokenizer, rows, removed: list[str], inner: list | None) -> list | None:
    """One :class:`HealMatcher` per row (``None`` when no row is healed).

    Each wraps the row's constraint matcher (``inner[r]``; ``inner`` is ``None`` for free
    text) and checks its first token against the row's last few tokens' text, as a
    whole-text tokenization would spell it.
    """
    if not any(removed):
        return None
    strings = token_strings(tokenizer)
    matchers = []
    for r, text in enumerate(removed):
        ends = rows.ends[r]
        window = rows.texts[r][ends[-4] if len(ends) >= 4 else 0:] if text else ""
        matchers.append(HealMatcher(text, inner[r] if inner is not None else None, strings,
                                    tokenizer, len(tokenizer), tokenizer.eos_token_id, window))
    return matchers
