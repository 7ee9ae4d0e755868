"""The one cache policy of the engines: what is derived from an object lives as long as it does.

Converting a tokenizer (an outlines_core ``Vocabulary``, an llguidance ``LLTokenizer``,
the text of every token) and compiling a constraint over it are expensive, so both are
kept, under one rule: everything cached for an *owner* (a tokenizer) is held in a table
keyed weakly by that owner, so it goes when the owner goes, and compiled constraints are
kept in a bounded least-recently-used table per owner, so memory stays bounded however
many constraints are built. Keys never use ``id()``, which a new object may reuse.

A cached value must not refer to its owner (it would keep it alive forever).
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from typing import Any, Callable, Hashable

__all__ = ["LRU", "derived", "compiled", "clear", "MAX_COMPILED"]

#: Compiled constraints kept per tokenizer (a JSON schema's can take megabytes).
MAX_COMPILED = 64


class LRU:
    """A bounded, thread-safe table that keeps the ``limit`` most recently used values.

    Two threads asking at once for a missing key may both build it; the first stored wins.
    """

    def __init__(self, limit: int):
        self.limit = limit
        self._items: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable, build: Callable[[], Any]) -> Any:
        """The value of ``key``, built (outside the lock) and stored when missing."""
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key]
        value = build()
        with self._lock:
            value = self._items.setdefault(key, value)
            while len(self._items) > self.limit:
                self._items.popitem(last=False)
        return value

    def __len__(self) -> int:
        return len(self._items)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()


class _Owned:
    """What is cached for one owner: derived values by name, compiled constraints in an LRU."""

    def __init__(self):
        self.derived: dict[str, Any] = {}
        self.compiled = LRU(MAX_COMPILED)


_LOCK = threading.Lock()
_OWNERS: "weakref.WeakKeyDictionary[Any, _Owned]" = weakref.WeakKeyDictionary()


def _owned(owner) -> _Owned:
    with _LOCK:
        found = _OWNERS.get(owner)
        if found is None:
            found = _OWNERS[owner] = _Owned()
        return found


def derived(owner, name: str, build: Callable[[], Any]) -> Any:
    """A value derived from ``owner`` (a tokenizer's conversion), built once while the owner lives."""
    table = _owned(owner).derived
    if name not in table:
        value = build()
        with _LOCK:
            table.setdefault(name, value)
    return table[name]


def compiled(owner, key: Hashable, build: Callable[[], Any]) -> Any:
    """A constraint compiled over ``owner``, among its :data:`MAX_COMPILED` most recently used."""
    return _owned(owner).compiled.get(key, build)


def clear(compiled_only: bool = False) -> None:
    """Forget what is cached: everything (the next builds start cold, as in a new process),
    or only the compiled constraints (the tokenizers' conversions stay)."""
    with _LOCK:
        if not compiled_only:
            _OWNERS.clear()
        for owned in _OWNERS.values():
            owned.compiled.clear()
