"""One cache policy for the engines: bounded, keyed by the tokenizer's identity, freed with it."""

import gc
import weakref

import pytest
from support.models import build_tokenizer

from continuous.engines import caches, llguidance, outlines_core
from continuous.heal import token_strings


@pytest.mark.parametrize("engine", [outlines_core, llguidance])
def test_many_constraints_for_one_tokenizer_keep_memory_bounded(tokenizer, monkeypatch, engine):
    monkeypatch.setattr(caches, "MAX_COMPILED", 3)
    caches.clear()
    first = engine.regex("a{1,2}", tokenizer)
    assert engine.regex("a{1,2}", tokenizer) is first  # the same constraint built twice is one object
    watch = weakref.ref(first)
    del first
    # Weak references to this test's own constraints: others that other tests keep alive do not count.
    built = [weakref.ref(engine.regex(f"b{{1,{n}}}", tokenizer)) for n in range(3, 13)]
    gc.collect()
    assert sum(ref() is not None for ref in built) <= 3  # ten more patterns, three kept
    assert watch() is None
    caches.clear()  # the next tests get a table of the usual size


def test_a_dead_tokenizer_frees_what_was_derived_from_it():
    tok = build_tokenizer(300, seed=5)
    constraint = weakref.ref(outlines_core.regex("[ab]+", tok))
    strings = weakref.ref(token_strings(tok))
    grammar = weakref.ref(llguidance.regex("[ab]+", tok))
    assert constraint() is not None and strings() is not None and grammar() is not None
    del tok
    gc.collect()
    assert constraint() is None and strings() is None and grammar() is None


def test_the_lru_keeps_the_most_recently_used():
    lru = caches.LRU(2)
    built = []
    for key in ["a", "b", "a", "c", "b"]:
        lru.get(key, lambda: built.append(key) or key)
    assert built == ["a", "b", "c", "b"]  # "a" was used again, so "b" went first
    assert len(lru) == 2
