"""A merged round's stacked cache is kept while the same calls go on, and rows compute as alone."""

import asyncio
from dataclasses import replace

import torch

from continuous import continuous, generate
from continuous.kv import JointRows
from continuous.models import joint as joint_module
from continuous.models.scheduler import Request, answered
from continuous.models.table import ALL
from continuous.transfer import cat_rows


def _states(model):
    gen = continuous(generate.text(model))
    return [gen(p, max_tokens=3) for p in ("User: tell me about Lima.\nAssistant:", "Once upon", "A list: 1, 2,")]


def _step(cache, token, call=None):
    """A one-token request of engine call ``call`` continuing ``cache`` (a single row whose every
    slot is a real token)."""
    return Request(torch.full((1, 1), token), torch.ones((1, cache.length + 1), dtype=torch.long), cache,
                   call=call)


def _steps(caches, token):
    """One request per call (call ``i`` continues ``caches[i]``)."""
    return [_step(c, token, i) for i, c in enumerate(caches)]


def test_rounds_of_the_same_calls_keep_the_stacked_cache_and_compute_as_alone(model, monkeypatch):
    stacked = []
    real_stack = joint_module.stack
    monkeypatch.setattr(joint_module, "stack", lambda *a: stacked.append(1) or real_stack(*a))
    caches = [s._rows.cache for s in _states(model)]
    for round_ in range(4):
        requests = _steps(caches, 7 + round_)
        alone = [model._run_one(Request(q.input_ids, q.attention_mask, q.cache)) for q in requests]
        for q, (_, c) in zip(requests, alone):
            c.release(q.cache.length)  # the reference's slots go back: the merged round appends there
        merged = model._run_joint(list(reversed(requests)))[::-1]  # any order
        for (a, _), (m, cache) in zip(alone, merged):
            assert torch.allclose(a, m, atol=1e-4)
        caches = [cache for _, cache in merged]
    assert len(stacked) == 1  # stacked once, then appended to
    # A call that leaves (another set of caches) makes the next round stack again.
    model._run_joint(_steps(caches[:2], 5))
    assert len(stacked) == 2


def _keys(cache):
    """Every layer's keys and values of a cache's slots, as one tensor per layer."""
    buffer = cache._buffer
    return [torch.cat([k[:, :, : cache.length], v[:, :, : cache.length]], -1)
            for k, v in zip(buffer.keys, buffer.values)]


def test_a_call_holds_its_rows_of_the_stacked_cache_until_read_and_one_that_left_gets_its_own(model):
    caches = [s._rows.cache for s in _states(model)]
    alone, merged = list(caches), list(caches)
    for round_ in range(3):
        alone = [model._run_one(_step(c, 7 + round_))[1] for c in alone]
        merged = [c for _, c in model._run_joint(_steps(merged, 7 + round_))]
    assert all(isinstance(c, JointRows) and c._own is None for c in merged)  # nothing copied yet
    left = merged[2]
    model._run_joint(_steps(merged[:2], 5))  # the third call left: the stack is made again
    assert left._own is not None and left._source is None  # copied out: the old stacked buffer is not held
    for a, m in zip(alone, merged):
        assert a.length == m.length and m.rows == a.rows
        for x, y in zip(_keys(a), _keys(m)):
            assert torch.allclose(x, y, atol=1e-4)
    grown = model._run_one(_step(left, 9))[1]  # continued alone, from its own buffer
    assert grown.length == left.length + 1 and torch.equal(_keys(grown)[0][:, :, : left.length], _keys(left)[0])


def test_accounting_does_not_copy_the_rows_out_and_a_finished_call_owns_its_cache(model):
    caches = [s._rows.cache for s in _states(model)]
    merged = [c for _, c in model._run_joint(_steps(caches, 7))]
    buffer, nbytes = merged[0].storage()
    assert merged[0]._own is None and buffer is merged[1].storage()[0]  # one stacked buffer, shared
    assert nbytes == buffer.nbytes

    gen = continuous(generate.text(model))
    prompts = ("One", "Two words", "And three more")

    async def together():
        return await asyncio.gather(*[gen.acall(p, max_tokens=6) for p in prompts])

    for state, prompt in zip(asyncio.run(together()), prompts):
        cache = state._rows.cache
        if isinstance(cache, JointRows):
            assert cache._source is None  # copied out: it holds no other call's rows
        assert str(state) == str(gen(prompt, max_tokens=6))


def test_the_calls_left_after_one_ends_go_on_in_one_merged_forward_a_step(model):
    """After a call ends, the others' merged steps go on (its rows left behind, never read):
    reusing the stacked cache once failed with one row too many, and every step fell back to
    one forward a call."""
    gen = continuous(generate.text(model))
    asks = [("one", 3), ("two", 12), ("three", 12)]
    alone = [str(gen(p, max_tokens=n)) for p, n in asks]
    failures, merged = [], model.engine.run_joint

    def recorded(requests):
        try:
            return merged(requests)
        except BaseException as exc:
            failures.append(exc)
            raise

    async def main():
        return await asyncio.gather(*[gen.acall(p, max_tokens=n) for p, n in asks])

    model.engine.run_joint = recorded
    try:
        states = asyncio.run(main())
    finally:
        model.engine.run_joint = merged
    assert not failures, failures[0]
    assert [str(s) for s in states] == alone


def test_a_call_that_ends_leaves_its_rows_behind_until_they_outnumber_the_others(model, monkeypatch):
    """Calls that end leave their rows in the stacked cache (nothing is copied for the others)
    until those rows outnumber the running ones; then the running ones are stacked again. Every
    call's output is the call's alone."""
    gen = continuous(generate.text(model))
    asks = [("one", 2), ("two", 3), ("three", 4), ("four", 12), ("five", 12)]
    alone = [gen(p, max_tokens=n) for p, n in asks]
    stacked, layouts = [], []
    real_stack, real_layout = joint_module.stack, model.joint.layout
    monkeypatch.setattr(joint_module, "stack", lambda *a: stacked.append(len(a[0])) or real_stack(*a))
    monkeypatch.setattr(model.joint, "layout", lambda rs: layouts.append(real_layout(rs)) or layouts[-1])
    engine = model.engine
    monkeypatch.setattr(engine, "_start_thread", lambda: None)  # stepped by hand, below
    streams = [gen.stream(p, max_tokens=n) for p, n in asks]
    calls = [s._submitted() for s in streams]
    for call in calls:
        engine.ask(call, ALL)
    while not all(c.done for c in calls):
        engine.step()
    for a, s in zip(alone, streams):
        b = s.run()
        assert list(a) == list(b) and a.token_ids.tolist() == b.token_ids.tolist()
    decoding = [(len(lay.requests), lay.rows, lay.kept) for lay in layouts if lay.start]
    # Five calls, then four and three on the same five rows; two left of five: stacked again.
    assert (4, 5, True) in decoding and (3, 5, True) in decoding
    assert (2, 2, False) in decoding and (2, 5, True) not in decoding
    assert stacked[-1] == 2


def test_buckets_hold_the_rows_with_a_few_sizes():
    from continuous.models.joint import bucket

    sizes = {bucket(n) for n in range(1, 129)}
    assert all(n <= bucket(n) < 2 * n or n == 1 for n in range(1, 129))
    assert all(bucket(n) - n < 8 for n in range(1, 129))
    assert sizes == {1, 2, 4, 8} | set(range(16, 129, 8))


def test_calls_forwarding_different_numbers_of_real_tokens_go_on_in_the_kept_stack_as_alone(model, monkeypatch):
    """A constrained call's forced run (several tokens) beside one-token steps: the narrower
    requests' new slots are holes before their tokens, and no cache is stacked again."""
    stacked = []
    real_stack = joint_module.stack
    monkeypatch.setattr(joint_module, "stack", lambda *a: stacked.append(1) or real_stack(*a))
    caches = [s._rows.cache for s in _states(model)]
    for widths in ((1, 1, 1), (3, 1, 2), (1, 1, 1), (1, 4, 1)):
        requests = [Request(torch.arange(5, 5 + w)[None] + i, None, c, call=i)
                    for i, (c, w) in enumerate(zip(caches, widths))]
        alone = [model._run_one(Request(q.input_ids, None, q.cache)) for q in requests]
        for q, (_, c) in zip(requests, alone):
            c.release(q.cache.length)
        merged = model._run_joint(requests)
        for (a, _), (m, cache), q in zip(alone, merged, requests):
            assert torch.allclose(a, m, atol=1e-4)
            assert cache.length == q.cache.length + q.width
        caches = [cache for _, cache in merged]
    assert len(stacked) == 1  # every round went on in the stacked cache (later rounds read what earlier wrote)


def test_holes_a_prefill_leaves_beside_decodes_are_squeezed_out_by_stacking_again(model, monkeypatch):
    """A fresh call's prefill merged with two calls' one-token steps leaves the decoders' rows a
    run of holes as wide as the prompt; the next step stacks the caches again, no wider than the
    longest call, and every row computes what it would alone."""
    from continuous.layout import COMPACT_SHARE

    layouts, real_layout = [], model.joint.layout
    monkeypatch.setattr(model.joint, "layout", lambda rs: layouts.append(real_layout(rs)) or layouts[-1])
    caches = [s._rows.cache for s in _states(model)[:2]]
    prompt = torch.arange(40, 64)[None]  # 24 tokens, no cache
    requests = [_step(c, 7, i) for i, c in enumerate(caches)] + [Request(prompt, None, None, call=2)]
    merged = model._run_joint(requests)
    caches = [cache for _, cache in merged]
    assert layouts[-1].start + 24 - max(c.length for c in caches) > COMPACT_SHARE * (layouts[-1].start + 24)
    for round_ in range(2):
        requests = [_step(c, 9 + round_, i) for i, c in enumerate(caches)]
        alone = [model._run_one(Request(q.input_ids, q.attention_mask, q.cache)) for q in requests]
        for q, (_, c) in zip(requests, alone):
            c.release(q.cache.length)
        merged = model._run_joint(requests)
        for (a, _), (m, _) in zip(alone, merged):
            assert torch.allclose(a, m, atol=1e-4)
        caches = [cache for _, cache in merged]
        assert layouts[-1].kept == bool(round_)  # stacked again once, then kept
        assert layouts[-1].start == max(q.cache.length for q in requests)


def test_a_layout_hands_each_request_its_rows_past_rows_of_no_call():
    from continuous.models.joint import Layout

    requests = [Request(torch.zeros((n, 1), dtype=torch.long), None, None) for n in (2, 1, 3)]
    # Rows 2 and 4 are of calls that left, 8 and 9 of none.
    layout = Layout(requests=requests, cache=None, slots=[], start=0, at=[0, 3, 5], rows=10)
    t = torch.arange(10)[:, None].expand(10, 4)
    blocks = layout.blocks(t)
    assert [b[:, 0].tolist() for b in blocks] == [[0, 1], [3], [5, 6, 7]]
    assert layout.dead == [(2, 3), (4, 5), (8, 10)]



def test_a_kept_step_s_mask_is_the_last_one_then_ones_in_one_tensor_with_room_for_more():
    joint = joint_module.Joint()
    assert joint.mask_after(None, 1) is None  # every slot real: no mask at all
    given = torch.tensor([[0, 1, 1], [1, 1, 1]])
    mask, seen = given, set()
    for step in range(12):  # past the room made at first: made again, larger
        mask = joint.mask_after(mask, 1 + step % 2)
        seen.add(mask.data_ptr())
        assert mask.tolist() == [[0] + [1] * (mask.shape[1] - 1), [1] * mask.shape[1]]
    assert mask.shape[1] == 3 + 6 * 1 + 6 * 2 and len(seen) < 4
    assert given.tolist() == [[0, 1, 1], [1, 1, 1]]  # never written
    other = torch.tensor([[1, 0], [1, 1]])  # not the kept step's: its own room
    assert joint.mask_after(other, 1).tolist() == [[1, 0, 1], [1, 1, 1]]


def test_requests_asking_for_the_last_slot_get_it_cut_out_once_and_a_shared_draw_takes_them_back_whole(model):
    caches = [s._rows.cache for s in _states(model)]
    requests = [replace(q, last=True) for q in _steps(caches, 7)]
    alone = [model._run_one(q) for q in requests]  # a backend's forward: every kept slot
    for q, (_, c) in zip(requests, alone):
        c.release(q.cache.length)  # the reference's slots go back: the merged step appends there
    merged = model._run_joint(requests)
    for (a, _), (m, _) in zip(alone, merged):
        assert a.dim() == 3 and m.shape == (1, a.shape[-1])
        assert torch.allclose(a[:, -1], m, atol=1e-4)
    whole = cat_rows([m for m, _ in merged])  # the rows of one tensor, in order: no copy
    assert whole.data_ptr() == merged[0][0].data_ptr() and whole.shape == (3, merged[0][0].shape[-1])
    # Beside a request that reads every slot it forwards, each still gets what it asked for.
    two = Request(torch.tensor([[3, 4]]), None, merged[0][1], logits_to_keep=2, call=0)
    out = model._run_joint([two] + [replace(_step(c, 5, i), last=True) for i, (_, c) in enumerate(merged) if i])
    assert out[0][0].shape[:2] == (1, 2) and [m.dim() for m, _ in out[1:]] == [2, 2]


def test_a_reply_is_cut_to_the_last_slot_only_for_a_request_that_asked_for_it():
    logits = torch.arange(24.0).reshape(2, 3, 4)
    ids = torch.zeros((2, 3), dtype=torch.long)
    assert torch.equal(answered(Request(ids, None, None, last=True), logits, "c")[0], logits[:, -1])
    assert answered(Request(ids, None, None), logits, "c") == (logits, "c")
    cut = logits[:, -1]  # a merged forward's: cut already
    assert answered(Request(ids, None, None, last=True), cut, "c")[0] is cut
