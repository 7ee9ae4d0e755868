"""The local KV cache is a value: crop and select never change another view; the tip appends in place."""

import asyncio
import gc
import threading
import weakref
from unittest.mock import patch

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support.states import assert_equivalent, real_ids

from continuous import continuous, generate, kv
from continuous.kv import ForwardCache


CPU = torch.device("cpu")


def fill(cache, rows, n, value, grouped=False):
    """One fake forward of `n` slots through a 2-layer model writing `value` (in inference mode, as the
    backend's); ``grouped``: with the layers' shapes known, as an eager model's forwards after its first."""
    fc = ForwardCache(cache, rows, n, [False, False], shapes=[(2, 4, 4, CPU)] * 2 if grouped else None)
    with torch.inference_mode():
        for layer in range(2):
            k = torch.full((rows, 2, n, 4), float(value))
            keys, values = fc.update(k, k.clone(), layer)
            assert keys.shape[2] == fc.end
    return fc.result(), fc


def keys(cache, layer=0):
    return cache._buffer.keys[layer][:, :, : cache.length]


def numbered(cache):
    """Write a different number in every slot of every row of ``cache``'s 2 layers."""
    with torch.inference_mode():
        for layer in range(2):
            for t in (cache._buffer.keys[layer], cache._buffer.values[layer]):
                t.copy_(torch.arange(t.numel(), dtype=t.dtype).reshape(t.shape) + (layer + 1) * 1000)


def test_tip_appends_in_place_and_older_views_stay_valid():
    a, _ = fill(None, 1, 5, 1)
    b, fc = fill(a, 1, 1, 2)
    assert fc._buffer is a._buffer  # no copy when extending the newest state
    assert a.length == 5 and torch.all(keys(a) == 1)
    assert b.length == 6 and keys(b)[0, 0, -1, 0] == 2
    # extending an older view copies its prefix first (copy on write)
    c, fc = fill(a, 1, 1, 3)
    assert fc._buffer is not a._buffer
    assert keys(b)[0, 0, -1, 0] == 2 and keys(c)[0, 0, -1, 0] == 3


def test_the_memory_of_a_dropped_state_is_freed_at_once_without_the_garbage_collector(model):
    """A forward leaves no reference cycle holding its buffer: an idle process may not collect
    garbage for a long time, and the buffer is the KV memory."""
    gen = continuous(generate.text(model))

    async def burst():  # merged steps too
        return await asyncio.gather(*[gen.acall(p, max_tokens=8) for p in ("Hello", "Once upon a time")])

    gc.collect()
    gc.disable()
    try:
        for make in (lambda: [gen(["Hello there", "A list: 1, 2,"], max_tokens=8)], lambda: asyncio.run(burst())):
            states = make()
            memory = [weakref.ref(s._rows.cache._buffer.keys[0]) for s in states]
            del states
            assert all(m() is None for m in memory)
    finally:
        gc.enable()


def test_decoding_does_not_copy_per_token():
    cache, _ = fill(None, 1, 10, 0)
    buffers = set()
    for i in range(500):
        cache, fc = fill(cache, 1, 1, i)
        buffers.add(id(fc._buffer))
    assert cache.length == 510
    assert len(buffers) <= 5  # capacity doubles: 64 -> 128 -> 256 -> 512 -> 1024


def test_crop_and_select():
    a, _ = fill(None, 3, 4, 0)
    with torch.inference_mode():
        a._buffer.keys[0][1, :, :4] = 7  # mark row 1
    cropped = a.crop(2)
    assert cropped.length == 2 and cropped._buffer is a._buffer
    assert a.crop(0) is None
    assert a.select_rows(torch.arange(3)) is a
    picked = a.select_rows(torch.tensor([1, 1, 0]))
    assert picked.rows == 3 and picked.length == 4
    assert torch.all(keys(picked)[:2] == 7) and torch.all(keys(picked)[2] == 0)
    assert torch.all(keys(a)[1] == 7) and torch.all(keys(a)[0] == 0)  # source unchanged
    grown, _ = fill(picked, 3, 1, 5)
    assert torch.all(keys(a)[:, :, :4][1] == 7)
    assert grown.length == 5


def test_failed_forward_leaves_the_view_usable():
    a, _ = fill(None, 1, 3, 1)
    fc = ForwardCache(a, 1, 2, [False, False])
    with torch.inference_mode():
        fc.update(torch.full((1, 2, 2, 4), 9.0), torch.full((1, 2, 2, 4), 9.0), 0)
    fc.abort()  # what the backend does when the forward raises
    # the forward died before result(): `a` is still the tip and still reads its own slots
    assert a._buffer.filled == 3 and torch.all(keys(a) == 1)
    b, _ = fill(a, 1, 1, 4)
    assert keys(b)[0, 0, -1, 0] == 4


def test_two_writers_of_one_tip_never_share_slots():
    a, _ = fill(None, 1, 3, 1)
    first = ForwardCache(a, 1, 2, [False, False])
    second = ForwardCache(a, 1, 2, [False, False])  # e.g. another thread continuing the same state
    assert first._buffer is a._buffer  # the tip was claimed: appends in place
    assert second._buffer is not a._buffer  # too late: copies its prefix
    assert torch.all(second._buffer.keys[0][:, :, :3] == 1)


def test_threads_continuing_states_that_share_a_tip_write_their_own_slots(model):
    gen = continuous(generate.text(model))
    base = gen("User: Tell me about Omar.\nAssistant:", max_tokens=4)
    suffixes = [f" and then {w}" for w in ("Lima", "Oslo", "Kyoto", "Perth", "Cairo", "Quito")]
    start = model.stats.snapshot()
    alone = {s: gen(base + s, max_tokens=12) for s in suffixes}
    before = model.stats.snapshot()
    sequential = {k: before[k] - start[k] for k in before}
    results, errors = {}, []

    def run(s):
        try:
            results[s] = gen(base + s, max_tokens=12)
        except Exception as exc:  # surfaced below: a thread's exception would be lost
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(s,)) for s in suffixes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    after = model.stats.snapshot()
    # The counters lost no update: the same tokens as the sequential runs, in shared passes.
    concurrent = {k: after[k] - before[k] for k in after}
    assert concurrent["tokens_forwarded"] == sequential["tokens_forwarded"]
    assert concurrent["forward_calls"] < sequential["forward_calls"]
    for s in suffixes:
        assert str(results[s]) == str(alone[s])
        assert real_ids(results[s]) == real_ids(alone[s])
        # Each result's cache holds its own tokens: continuing it equals recomputing it.
        assert_equivalent(gen, results[s], n=3)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 3), st.sets(st.integers(0, 7), max_size=6), st.integers(1, 5)), min_size=2,
                max_size=5), st.booleans(), st.booleans(), st.booleans())
def test_stacking_calls_rows_of_a_stacked_buffer_again_keeps_each_call_s_slots(parts, mixed, grouped, own_grouped):
    """Calls' rows of a merged step's stacked buffer (each with its own slots: a run after a
    few scattered ones, or a run alone), stacked again: every part's slots hold what its own
    copy holds, whether each buffer's layers are grouped or not (a large buffer's split in
    groups of one layer)."""
    from continuous.kv import JointRows, Slots, stack

    total = sum(n for n, _, _ in parts)
    with patch.object(kv, "GROUP_BYTES", total * 2 * 64 * 4 * 4):  # the source's layers: one a group
        source, _ = fill(None, total, 16, 0, grouped)
    numbered(source)
    caches, at = [], 0
    for n, scattered, run in parts:
        base = torch.tensor(sorted(scattered), dtype=torch.long) if scattered else None
        caches.append(JointRows(source._buffer, slice(at, at + n), Slots(base, range(8, 8 + run))))
        at += n
    rows = [n for n, _, _ in parts]
    if mixed:  # a cache of its own among them (a call that joins), copied as it is
        own, _ = fill(None, 2, 3, 7, own_grouped)
        caches, rows = caches + [own], rows + [2]
    out = stack(caches, rows, 4)
    assert out.length == max(c.length for c in caches)
    at = 0
    for cache, n in zip(caches, rows):
        for layer in range(2):
            want = cache.layer(layer)
            got = (out._buffer.keys[layer], out._buffer.values[layer])
            for w, g in zip(want, got):
                assert torch.equal(g[at : at + n, :, : cache.length], w)
                assert torch.isfinite(g[at : at + n]).all()
        at += n


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 3), st.integers(1, 3), st.sets(st.integers(0, 7), max_size=5), st.integers(0, 6),
       st.integers(1, 6), st.booleans())
def test_a_call_s_rows_of_a_stacked_buffer_read_and_settled_hold_its_slots_in_order(first, n, scattered, start, run,
                                                                                    grouped):
    """A call's rows of a stacked buffer (slots: a few scattered ones then a run, or a run alone)
    read the same, whether read in place or once copied into their own buffer; the copy has room
    for the next slot, and zeros past the call's slots."""
    from continuous.kv import JointRows, Slots

    with patch.object(kv, "GROUP_BYTES", (first + n + 1) * 2 * 64 * 4 * 4):  # one layer a group: copied by pieces
        source, _ = fill(None, first + n + 1, 16, 0, grouped)
    numbered(source)
    base = torch.tensor(sorted(scattered), dtype=torch.long)
    slots = Slots(base if len(base) else None, range(8 + start, 8 + start + run))
    order = torch.cat([base, torch.arange(8 + start, 8 + start + run)])
    rows = JointRows(source._buffer, slice(first, first + n), slots)
    assert rows.length == len(order)
    want = [(t[first : first + n][:, :, order].clone(), u[first : first + n][:, :, order].clone())
            for t, u in zip(source._buffer.keys, source._buffer.values)]
    for layer in range(2):
        for w, g in zip(want[layer], rows.layer(layer)):
            assert torch.equal(g, w)
    # Memory handed out as it is (here: NaN) must not show past the slots the copy wrote.
    with patch.object(torch, "empty", lambda shape, **kw: torch.full(shape, float("nan"), **kw)):
        own = rows.settle()
    assert own.capacity > rows.length and own.rows == n
    for layer in range(2):
        for w, g, whole in zip(want[layer], rows.layer(layer), (own.keys[layer], own.values[layer])):
            assert torch.equal(g, w)
            assert not whole[:, :, rows.length :].any()


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.data(), st.sampled_from(["cache", "in place", "settled"]), st.booleans())
def test_a_part_of_a_cache_holds_its_rows_and_slots_in_order_read_in_place_or_copied(n, data, parent_is, two_runs):
    """Some rows and slots of a cache (a table's call leaving with its rows): of a cache of its own,
    of a call's rows still in a stacked buffer, or of those rows once copied out, the part reads
    those rows' slots in order, before and after it is copied into a buffer of its own."""
    from continuous.kv import JointRows, Slots

    source, _ = fill(None, n + 2, 12, 0)
    numbered(source)
    if parent_is == "cache":
        parent = source.crop(10)
        first = 0
    else:
        first = data.draw(st.integers(0, 2))
        scattered = sorted(data.draw(st.sets(st.integers(0, 5), max_size=4)))
        parent = JointRows(source._buffer, slice(first, first + n), Slots(torch.tensor(scattered, dtype=torch.long)
                                                                          if scattered else None, range(6, 10)))
        if parent_is == "settled":
            parent.settle()
    rows = data.draw(st.tuples(st.integers(0, n - 1), st.integers(1, n)).filter(lambda r: r[0] < r[1]))
    if two_runs:
        cut = data.draw(st.integers(0, parent.length))
        start = data.draw(st.integers(cut, parent.length))
        slots, order = Slots(range(cut), range(start, parent.length)), list(range(cut)) + list(range(start,
                                                                                                  parent.length))
    else:
        order = sorted(data.draw(st.sets(st.integers(0, parent.length - 1), min_size=1)))
        slots = Slots(torch.tensor(order, dtype=torch.long))
    part = parent.part(slice(*rows), slots)
    assert part.length == len(order) and part.rows == rows[1] - rows[0]
    want = [[t[rows[0] : rows[1]][:, :, order] for t in parent.layer(layer)] for layer in range(2)]
    for copied in (False, True):
        if copied:
            part.settle()
        for layer in range(2):
            for w, g in zip(want[layer], part.layer(layer)):
                assert torch.equal(g, w)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from([(2, 4, 4, CPU), (1, 8, 4, CPU), (2, 4, 8, CPU)]), min_size=1, max_size=6),
       st.integers(1, 3), st.integers(1, 5), st.booleans())
def test_layers_of_one_shape_share_a_tensor_and_copies_keep_them_so(shapes, rows, n, known):
    """With the layers' shapes known, each run of layers of one shape is one tensor, each layer a
    view of it: a forward's writes land in it, and a copy of some rows, or a stack, holds them
    grouped the same way. Not known (a model's first forward, or a compiled model's), each layer
    is a tensor of its own, and so are its copies' (a compiled step takes them as its inputs)."""
    from continuous.kv import stack

    fc = ForwardCache(None, rows, n, [False] * len(shapes), shapes=shapes if known else None)
    with torch.inference_mode():
        for layer, (heads, key_dim, value_dim, _) in enumerate(shapes):
            fc.update(torch.full((rows, heads, n, key_dim), layer + 1.0), torch.full((rows, heads, n, value_dim), -1.0),
                      layer)
    cache = fc.result()
    runs = [shape for i, shape in enumerate(shapes) if i == 0 or shapes[i - 1] != shape]
    buffer = cache.holder()
    assert len(buffer.groups) == (len(runs) if known else len(shapes)) and buffer.shapes() == shapes
    at = 0
    for keys, values in buffer.groups:
        for i in range(keys.shape[0]):  # the layer's view is the group's memory
            assert cache._buffer.keys[at + i].data_ptr() == keys[i].data_ptr()
            assert torch.all(keys[i, :, :, :n] == at + i + 1) and torch.all(values[i, :, :, :n] == -1)
        at += keys.shape[0]
    picked = cache.select_rows(torch.tensor([rows - 1, 0]))
    stacked = stack([picked, cache], [2, rows], 1)
    for copy in (picked, stacked):
        assert [k.shape[0] for k, _ in copy.holder().groups] == [k.shape[0] for k, _ in buffer.groups]
    for layer in range(len(shapes)):
        assert torch.equal(picked.layer(layer)[0], cache.layer(layer)[0][[rows - 1, 0]])
        assert not picked._buffer.keys[layer][:, :, n:].any()


def test_an_eager_model_s_caches_hold_their_layers_as_one_tensor_after_its_first_forward(model):
    gen = continuous(generate.text(model))
    gen("Hello", max_tokens=2)  # the model learns its layers' shapes
    layers = len(model.kinds)
    assert model.kv_shapes is not None and len(model.kv_shapes) == layers
    state = gen(["Hello there", "Hi"], max_tokens=3)
    (keys, values), = state._rows.cache.holder().groups
    assert keys.shape[0] == values.shape[0] == layers
    assert state._rows.cache.storage()[1] == keys.numel() * keys.element_size() * 2


def test_layers_on_different_devices_never_share_a_group():
    """A model split over devices (``device_map``) keeps each device's layers in tensors on it."""
    from continuous.kv import _Buffer

    meta = torch.device("meta")
    buffer = _Buffer(2, 64)
    buffer.allocate([(2, 4, 4, CPU)] * 2 + [(2, 4, 4, meta)] * 3 + [(2, 4, 4, CPU)], torch.float32, grouped=True)
    assert [k.shape[0] for k, _ in buffer.groups] == [2, 3, 1]
    assert [k.device for k in buffer.keys] == [CPU] * 2 + [meta] * 3 + [CPU]
    assert buffer.shapes() == [(2, 4, 4, k.device) for k in buffer.keys]
