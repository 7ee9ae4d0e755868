"""An automatic prefix cache: recent states kept by a model, reused by prompts that start like them.

A state's rows carry their KV cache, and a slice keeps it: so a prompt whose first
tokens are the first tokens of a kept row needs only the rest forwarded. Kept rows sit
in a trie over their cached token ids; a prompt walks it as far as its own ids go and
takes the row found deepest. Rows are evicted least recently used first, while the
buffers they hold take more than the budget (a buffer shared by several rows counts once).

Reuse never changes what a call computes: a row's cached keys and values are those of
its tokens at their positions, whatever came after them.
"""

from __future__ import annotations

import itertools
import re
import threading
from collections import OrderedDict
from dataclasses import replace

import torch

from .kv import stack
from .layout import Rows

__all__ = ["PrefixCache", "parse_bytes", "MIN_REUSE"]

#: The fewest tokens worth taking from a kept row: a shorter match (a BOS every prompt
#: starts with) costs a copy of the cache for no saving.
MIN_REUSE = 4

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(size) -> int:
    """A byte count from an int or a string such as ``"2GB"``, ``"512 MiB"`` or ``"1e9"``.

    Raises
    ------
    ValueError
        For anything else, or a negative size.
    """
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    elif isinstance(size, str) and (m := re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", size)) \
            and m.group(2).lower() in _UNITS:
        try:
            value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
        except ValueError:
            value = -1
    else:
        value = -1
    if value < 0:
        raise ValueError(f"a cache size is a non-negative int of bytes or a string such as '2GB' or '512MiB', "
                         f"got {size!r}")
    return value


class _Node:
    __slots__ = ("children", "count", "last")

    def __init__(self):
        self.children: dict[int, _Node] = {}
        self.count = 0  # entries whose ids pass through (or end at) this node
        self.last: int | None = None  # the newest such entry


class PrefixCache:
    """Recent rows of a model's states, found by the longest common prefix of token ids.

    Parameters
    ----------
    max_bytes
        The budget of KV cache bytes the kept rows may hold.
    """

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.root = _Node()
        self.entries: OrderedDict[int, tuple[Rows, int, tuple[int, ...], int]] = OrderedDict()  # LRU first
        self.buffers: dict[int, list] = {}  # id(buffer) -> [bytes, entries on it]
        self.bytes = 0
        self._ids = itertools.count()
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.entries)

    def clear(self) -> None:
        """Forget every kept row (their buffers are freed with the last state using them)."""
        with self.lock:
            self.root, self.bytes = _Node(), 0
            self.entries.clear()
            self.buffers.clear()

    def insert(self, rows: Rows) -> None:
        """Keep each row of ``rows`` (its cached tokens), evicting the least recently used rows past the budget.

        Rows on a buffer larger than the whole budget are not kept, and nothing is evicted
        for them: one long state would otherwise wipe every shorter prefix that others share.
        """
        if rows.cache is None:
            return
        buffer, size = rows.cache.storage()
        cached = rows.cached_lengths().tolist()
        with self.lock:
            if size > self.max_bytes and id(buffer) not in self.buffers:
                return
            for r in range(rows.n_rows):
                ids = tuple(rows.real_ids(r)[: cached[r]])
                if ids and self._depth(ids) < len(ids):  # not already kept whole
                    self._add(rows, r, ids, buffer, size)
            self._evict()

    def _add(self, rows: Rows, r: int, ids: tuple[int, ...], buffer, size: int) -> None:
        key = next(self._ids)
        self.entries[key] = (rows, r, ids, id(buffer))
        held = self.buffers.setdefault(id(buffer), [size, 0])
        if held[1] == 0:
            self.bytes += size
        held[1] += 1
        node = self.root
        for t in ids:
            node.count += 1
            node.last = key
            node = node.children.setdefault(t, _Node())
        node.count += 1
        node.last = key

    def _evict(self) -> None:
        while self.bytes > self.max_bytes and self.entries:
            key, (_, _, ids, buffer) = self.entries.popitem(last=False)
            held = self.buffers[buffer]
            held[1] -= 1
            if held[1] == 0:
                self.bytes -= held[0]
                del self.buffers[buffer]
            self._unlink(key, ids)

    def _unlink(self, key: int, ids: tuple[int, ...]) -> None:
        """Take an entry off its path, deepest node first; nodes no entry passes through go."""
        path = [self.root]
        for t in ids:
            path.append(path[-1].children[t])
        for depth in range(len(ids), -1, -1):
            node = path[depth]
            node.count -= 1
            if node.count == 0 and depth:
                del path[depth - 1].children[ids[depth - 1]]
            elif node.last == key:
                node.last = next((c.last for c in node.children.values()), None)
                if node.last is None:  # only entries that end here pass through
                    node.last = next((k for k, e in reversed(self.entries.items()) if e[2] == ids[:depth]), None)

    def _depth(self, ids) -> int:
        node, depth = self.root, 0
        for t in ids:
            node = node.children.get(t)
            if node is None:
                break
            depth += 1
        return depth

    def _longest(self, ids: list[int]) -> tuple[int | None, int]:
        """The newest entry sharing the longest prefix with ``ids``, and that prefix's length."""
        node, depth, found = self.root, 0, None
        for t in ids:
            node = node.children.get(t)
            if node is None or node.last is None:
                break
            depth, found = depth + 1, node.last
        return found, depth

    def reuse(self, rows: Rows, lengths: list[int] | None = None) -> tuple[Rows, int]:
        """``rows`` (fresh prompts, no cache) with each row's longest kept prefix taken from the cache.

        At least each row's last token is left to forward, for its logits.

        Parameters
        ----------
        rows
            The prompts.
        lengths
            Per row, how many of its first tokens the call keeps (healing crops the last
            few and spells them again): only a prefix of those is taken, the last of them
            left to forward. ``None``: all of them.

        Returns
        -------
        rows, saved
            The rows to top up, and how many prompt tokens they need not forward.
        """
        if rows.cache is not None or not self.entries:
            return rows, 0
        parts, saved = [], 0
        with self.lock:
            for r in range(rows.n_rows):
                ids = rows.real_ids(r)
                key, depth = self._longest(ids[: (len(ids) if lengths is None else lengths[r]) - 1])
                if key is None or depth < MIN_REUSE:
                    parts.append((None, 0))
                    continue
                self.entries.move_to_end(key)
                entry, er, _, _ = self.entries[key]
                parts.append(((entry, er), depth))
                saved += depth
        if not saved:
            return rows, 0
        return _assemble(rows, parts), saved


def _assemble(rows: Rows, parts: list) -> Rows:
    """Each row of ``rows`` on the cache of its kept prefix (or none), stacked into one layout."""
    pieces = []
    for r, (entry, depth) in enumerate(parts):
        ids, text = rows.real_ids(r), rows.texts[r]
        if entry is None:
            pieces.append((None, [], ids))
            continue
        kept, er = entry
        one = kept.select([er]) if kept.n_rows > 1 else kept
        one = one.edit([(depth, [], [], text)])  # crop to the prefix: its cache is a view
        pieces.append((one.cache, one.token_ids[0][: one.cache.length].tolist() if one.cache else [],
                       ids[depth:], one.attention_mask[0][: one.cache.length].tolist() if one.cache else []))
    return _layout(rows, pieces)


def _layout(rows: Rows, pieces: list) -> Rows:
    """The grid of rows whose caches differ: cached slots first (holes up to the longest),
    then the uncached tokens right-aligned."""
    caches = [p[0] for p in pieces]
    start = max((c.length for c in caches if c is not None), default=0)
    width = max(len(p[2]) for p in pieces)
    n = rows.n_rows
    token_ids = torch.full((n, start + width), rows.pad, dtype=torch.long)
    mask = torch.zeros((n, start + width), dtype=torch.long)
    for r, piece in enumerate(pieces):
        if piece[0] is not None:
            _, slots, rest, slot_mask = piece
            token_ids[r, : len(slots)] = torch.tensor(slots)
            mask[r, : len(slots)] = torch.tensor(slot_mask)
        else:
            rest = piece[2]
        token_ids[r, start + width - len(rest):] = torch.tensor(rest, dtype=torch.long)
        mask[r, start + width - len(rest):] = 1
    cache = stack(caches, [1] * n, width) if any(c is not None for c in caches) else None
    if cache is not None and n == 1:
        cache = caches[0]  # one row: its own view, not a copy
    return replace(rows, token_ids=token_ids, attention_mask=mask, cache=cache)
