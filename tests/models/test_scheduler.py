"""Concurrent calls share forward passes, and each call's result equals the same call alone."""

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel
from support.states import same_as_alone
from support.streams import drained
from support.waiting import until

from continuous import continuous, generate, models
from continuous.models.scheduler import Request, split
from continuous.prefix import parse_bytes


class City(BaseModel):
    name: str
    population: int


def _calls(model):
    """Calls of every kind and option, each ``(name, generator, prompt, kwargs)``."""
    text = continuous(generate.text(model))
    return [
        ("greedy", text, "User: tell me about Lima.\nAssistant:", dict(max_tokens=24)),
        ("seeded", text, "User: tell me about Oslo.\nAssistant:", dict(max_tokens=20, temperature=0.9, seed=11)),
        ("top_p", text, "Once upon a time", dict(max_tokens=16, top_p=0.8, seed=3, logprobs=2)),
        ("stop", text, "User: count to ten.\nAssistant:", dict(max_tokens=30, stop_at=[" the", "."])),
        ("short", text, "Hi", dict(max_tokens=3)),
        ("batch", text, ["Rome is", "Kyoto is a city"], dict(max_tokens=12)),
        ("json", continuous(generate.json(model, City)), "A city as JSON:", dict(max_tokens=40)),
        ("choice", continuous(generate.choice(model, ["yes", "no", "maybe later"])), "Answer:", {}),
        ("regex", continuous(generate.regex(model, r"[0-9]{3}-[a-z]{2,4}")), "Code:", {}),
        ("ban", continuous(generate.text(model, ban=["the", "and"])), "Write:", dict(max_tokens=20)),
        ("heal", text, "The capital of Fra", dict(max_tokens=8, heal=True)),
        ("samples", continuous(generate.text(model, generate_sampler(3))), "Pick:", dict(max_tokens=10, seed=5)),
    ]


def generate_sampler(n):
    from continuous import samplers

    return samplers.multinomial(n)


def _run(call):
    _, gen, prompt, kwargs = call
    return gen(prompt, **kwargs)


def test_threads_share_steps_and_each_call_equals_the_call_alone(model):
    calls = _calls(model)
    model.stats.reset()
    alone = [_run(c) for c in calls]
    sequential = model.stats.snapshot()
    model.stats.reset()
    with ThreadPoolExecutor(len(calls)) as pool:
        together = list(pool.map(_run, calls))
    shared = model.stats.snapshot()
    for (name, *_), a, b in zip(calls, alone, together):
        same_as_alone(a, b)
    assert shared["tokens_forwarded"] == sequential["tokens_forwarded"]
    assert shared["forward_calls"] < sequential["forward_calls"] / 2


def test_async_calls_and_streams_interleaved_equal_the_calls_alone(model):
    calls = _calls(model)[:8]
    alone = [_run(c) for c in calls]

    async def main():
        jobs = [drained(g, p, k) if i % 2 else g.acall(p, **k) for i, (_, g, p, k) in enumerate(calls)]
        return await asyncio.gather(*jobs)

    model.stats.reset()
    together = asyncio.run(main())
    for a, b in zip(alone, together):
        same_as_alone(a, b)
    assert model.stats.forward_calls < sum(1 for _ in calls) * 10


def test_a_state_made_together_continues_as_one_made_alone(model):
    calls = _calls(model)[:6]
    with ThreadPoolExecutor(len(calls)) as pool:
        together = list(pool.map(_run, calls))
    alone = [_run(c) for c in calls]
    gen = continuous(generate.text(model))
    for a, b in zip(alone, together):
        same_as_alone(gen(a + " And", max_tokens=6), gen(b + " And", max_tokens=6))
        same_as_alone(gen(b + " And", max_tokens=6), gen((b + " And").drop_cache(), max_tokens=6))


class _Boom:
    """A processor that fails at a given step."""

    def __init__(self, at):
        self.at, self.seen = at, 0

    def __call__(self, input_ids, scores):
        self.seen += 1
        if self.seen == self.at:
            raise RuntimeError("boom")
        return scores


@pytest.mark.filterwarnings("ignore:the model's context")
def test_a_failing_cancelled_or_cut_call_leaves_the_others_unchanged(hf_model, tokenizer):
    model = models.transformers(hf_model, tokenizer, prefill_chunk=64)  # its own engine
    gen = continuous(generate.text(model))
    others = [(f"User: tell me about {w}.\nAssistant:", 20) for w in ("Lima", "Oslo", "Kyoto", "Perth")]
    alone = [gen(p, max_tokens=n) for p, n in others]
    long_prompt = "word"
    while len(tokenizer(long_prompt)["input_ids"]) < 500:  # near the 512-token context: cut by it
        long_prompt += " word"

    async def cancelled():
        task = asyncio.ensure_future(gen.acall("Once upon a time", max_tokens=200))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    async def failing():
        with pytest.raises(RuntimeError, match="boom"):
            await gen.acall("Hello there", max_tokens=30, logits_processors=[_Boom(4)])

    async def cut():
        return await gen.acall(long_prompt, max_tokens=40)

    async def main():
        results = await asyncio.gather(*[gen.acall(p, max_tokens=n) for p, n in others],
                                       cancelled(), failing(), cut())
        return results[: len(others)], results[-1]

    together, short = asyncio.run(main())
    for a, b in zip(alone, together):
        same_as_alone(a, b)
    assert short.finish_reasons == ["context"]
    # Nothing is left waiting: a call alone runs at once.
    assert list(gen("Hi", max_tokens=4)) == list(gen("Hi", max_tokens=4))
    assert not model.engine.table.waiting and not model.engine.table.calls


def test_a_long_prefill_is_cut_into_chunks_between_other_calls_steps(hf_model, tokenizer):
    model = models.transformers(hf_model, tokenizer, prefill_chunk=16)
    gen = continuous(generate.text(model))
    widths, lock = [], threading.Lock()
    run_one = model.engine.run_one

    def spy(request):
        with lock:
            widths.append(request.width)
        return run_one(request)

    model.engine.run_one = spy
    long_prompt = " ".join(["story"] * 80)
    alone_long = gen(long_prompt, max_tokens=4)
    alone_short = gen("Hello", max_tokens=60)
    widths.clear()
    started = threading.Event()
    results = {}

    def short():
        stream = gen.stream("Hello", max_tokens=60)
        for i, _ in enumerate(stream):
            if i == 2:
                started.set()
        results["short"] = stream.state

    def long():
        started.wait(10)
        results["long"] = gen(long_prompt, max_tokens=4)

    threads = [threading.Thread(target=short), threading.Thread(target=long)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    same_as_alone(results["short"], alone_short)
    same_as_alone(results["long"], alone_long)
    chunks = [i for i, w in enumerate(widths) if w == 16]
    assert len(chunks) >= 5
    # Decode steps of the short call ran between the long prompt's first and last chunks.
    assert any(w == 1 for w in widths[chunks[0] : chunks[-1]])


def _request(width, rows=1):
    return Request(torch.zeros((rows, width), dtype=torch.long), None, None)


def test_split_groups_requests_that_pad_well_and_keeps_long_ones_apart():
    ones = [_request(1) for _ in range(6)]
    forced = _request(3)
    prompts = [_request(12), _request(14, rows=2)]
    prefill = _request(600)
    groups, wide = split(ones + [forced] + prompts + [prefill], chunk=512)
    # With the forced run, 9 real slots would pad to 7 x 3 = 21: it goes with the prompts.
    assert groups == [ones, [forced] + prompts]
    assert wide == [prefill]
    pair = [_request(1), _request(1)]
    groups, wide = split(pair + [forced], chunk=512)
    assert groups == [pair + [forced]] and not wide  # 5 real slots padded to 9
    # A backend that pads nothing runs every request up to the chunk in one forward.
    groups, wide = split(ones + [forced] + prompts + [prefill], chunk=512, pads=False)
    assert groups == [ones + [forced] + prompts] and wide == [prefill]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 700), st.integers(1, 4)), min_size=1, max_size=20))
def test_split_takes_every_request_once_and_never_pads_a_group_past_twice_its_tokens(shapes):
    batch = [_request(w, rows) for w, rows in shapes]
    groups, wide = split(batch, chunk=512)
    taken = [r for g in groups for r in g] + wide
    assert sorted(map(id, taken)) == sorted(map(id, batch))
    for g in groups:
        real = sum(r.batch_rows * r.width for r in g)
        assert sum(r.batch_rows for r in g) * max(r.width for r in g) <= 2 * real or len(g) == 1
    assert all(r.width > 512 for r in wide)


def test_a_request_is_chunked_so_that_its_last_chunk_keeps_its_logits():
    mask = torch.ones((2, 40), dtype=torch.long)
    request = Request(torch.zeros((2, 40), dtype=torch.long), mask, None, logits_to_keep=5)
    first = request.chunk(16)
    assert first.width == 16 and first.attention_mask.shape == (2, 16)
    assert first.logits_to_keep == 1
    tail = Request(torch.zeros((2, 7), dtype=torch.long), None, None, logits_to_keep=5)
    assert tail.chunk(4).width == 2  # leaves 5 slots: the logits asked for
    assert _request(4).chunk(16) is None


def test_a_prompt_forwarded_in_chunks_is_written_into_one_buffer_made_once(hf_model, tokenizer):
    model = models.transformers(hf_model, tokenizer, prefill_chunk=16)
    ids = tokenizer(" ".join(["story"] * 60), return_tensors="pt").input_ids
    buffers, run_one = [], model.engine.run_one

    def spy(request):
        logits, cache = run_one(request)
        buffers.append(cache.storage()[0])
        return logits, cache

    model.engine.run_one = spy
    logits, cache = model.forward(ids, None, None)
    assert len(buffers) == -(-ids.shape[1] // 16) > 2
    assert all(b is buffers[0] for b in buffers) and buffers[0].capacity >= ids.shape[1]
    whole, _ = models.transformers(hf_model, tokenizer).forward(ids, None, None)
    torch.testing.assert_close(logits, whole, atol=1e-4, rtol=1e-4)


def _own_rows_only(state):
    """The state's cache is a buffer of its own rows (no other call's rows stacked beside them), and
    its logits and weights are tensors of its own rows (not views of the step's tensors of every call)."""
    buffer, nbytes = state._rows.cache.storage()
    tensors = [state._rows.logits, state._weights]
    counted = state.cache_bytes.alone + state.cache_bytes.shared
    return (buffer.keys[0].shape[0] == state._rows.n_rows and counted == nbytes
            and all(t.untyped_storage().nbytes() == t.nelement() * t.element_size() for t in tensors))


def test_two_calls_continuing_the_same_state_at_once_each_equal_the_call_alone(model):
    gen = continuous(generate.text(model))
    prompts = ["User: hello.\nAssistant: Nice to meet", "User: where do you live?\nAssistant:"]

    async def made():
        return await asyncio.gather(*[gen.acall(p, max_tokens=4) for p in prompts])

    first, second = asyncio.run(made())  # made together: their caches were stacked, and they ended together
    # Exactly as many calls as the last merged step had, all continuing one of its states.
    pair = [(first, " you. User: I live in", {}), (first, " you too!", dict(temperature=0.8, seed=4))]
    turns = pair + [(second, " In Paris", {}), (first, " you. User: I live in", dict(temperature=0.8, seed=4))]
    alone = [gen(s + t, max_tokens=10, **k) for s, t, k in turns]

    async def together(calls):
        return await asyncio.gather(*[gen.acall(s + t, max_tokens=10, **k) for s, t, k in calls])

    for calls in (pair, turns, turns):
        for a, b in zip(alone, asyncio.run(together(calls))):
            same_as_alone(a, b)
            assert _own_rows_only(b)
    with ThreadPoolExecutor(len(turns)) as pool:
        threaded = list(pool.map(lambda x: gen(x[0] + x[1], max_tokens=10, **x[2]), turns))
    for a, b in zip(alone, threaded):
        same_as_alone(a, b)


def test_a_state_continued_while_its_call_still_holds_its_rows_equals_it_continued_alone(model):
    gen = continuous(generate.text(model))

    async def main():
        stream = gen.astream("User: tell me about Lima.\nAssistant:", max_tokens=30)
        other = asyncio.ensure_future(gen.acall("Once upon a time", max_tokens=30))
        got = []
        async for piece in stream:
            got.append(piece)
            if len(got) == 4:
                break
        snapshot = stream.state  # its rows are still in the stacked cache of the running calls
        go_on = asyncio.ensure_future(gen.acall(snapshot + " And", max_tokens=12))
        rest = [p async for p in stream]
        return snapshot, await go_on, await other, got + rest, stream.state

    snapshot, continued, other, pieces, final = asyncio.run(main())
    same_as_alone(continued, gen((snapshot + " And").drop_cache(), max_tokens=12))
    same_as_alone(other, gen("Once upon a time", max_tokens=30))
    assert str(final) == "User: tell me about Lima.\nAssistant:" + "".join(pieces)
    assert list(final) == list(gen("User: tell me about Lima.\nAssistant:", max_tokens=30))


def test_a_stream_closed_while_its_steps_are_shared_ends_with_a_state_of_its_own_memory(model):
    gen = continuous(generate.text(model))
    prompt = "User: tell me about Lima.\nAssistant:"

    async def main():
        stream = gen.astream(prompt, max_tokens=30)
        others = [asyncio.ensure_future(gen.acall(p, max_tokens=30)) for p in ("Once upon a time", "A list: 1,")]
        got = []
        async for piece in stream:
            got.append(piece)
            if len(got) == 4:
                break
        await stream.aclose()
        await asyncio.gather(*others)
        return stream.state, got

    state, got = asyncio.run(main())
    assert str(state) == prompt + "".join(got) and _own_rows_only(state)  # what its consumer saw
    assert state.cache_bytes.shared == 0  # no other live state of the stream holds its buffer


def test_a_state_read_mid_stream_while_steps_are_shared_holds_only_its_own_memory(model):
    """A consumer may keep the state it read mid-stream: it holds its own rows, not the stacked cache
    of every call sharing the steps, nor the step's logits of them all."""
    gen = continuous(generate.text(model))
    prompt = "User: tell me about Lima.\nAssistant:"

    async def main():
        stream = gen.astream(prompt, max_tokens=12)
        others = [asyncio.ensure_future(gen.acall(p, max_tokens=30)) for p in ("Once upon a time", "A list: 1,")]
        got, kept = [], None
        async for piece in stream:
            got.append(piece)
            if len(got) == 4:
                kept = stream.state
        await asyncio.gather(*others)
        return kept, got

    kept, got = asyncio.run(main())
    assert str(kept) == prompt + "".join(got[:4]) and _own_rows_only(kept)
    assert str(gen(kept, max_tokens=5)).startswith(str(kept))  # and it goes on


def test_after_the_calls_end_the_model_holds_no_cache_of_theirs(hf_model, tokenizer):
    model = models.transformers(hf_model, tokenizer, prefill_chunk=200)  # its own engine: no other test's calls
    gen = continuous(generate.text(model))
    prompts = ["One", "Two words", "And three more words"]

    async def together():
        return await asyncio.gather(*[gen.acall(p, max_tokens=8) for p in prompts])

    states = asyncio.run(together())
    engine = model.engine
    assert not engine.table.calls and not engine.table.waiting and engine.table.rows == engine.table.kv == 0
    assert model.joint.cache is None and not model.joint.calls
    assert all(_own_rows_only(s) for s in states)
    assert model.stats.calls_running == model.stats.calls_waiting == model.stats.kv_bytes_in_use == 0
    assert model.stats.steps > 0 and model.stats.rows_per_step >= 1


def test_a_call_cancelled_during_its_prefill_leaves_at_the_next_chunk_and_nobody_waits(hf_model, tokenizer):
    model = models.transformers(hf_model, tokenizer, prefill_chunk=16)
    gen = continuous(generate.text(model))
    long_prompt = " ".join(["story"] * 80)
    alone = gen("Hello", max_tokens=20)
    engine, run_one = model.engine, model.engine.run_one
    widths, first_chunk, cancelled = [], threading.Event(), threading.Event()

    def spy(request):
        widths.append(request.width)
        if request.width == 16 and not first_chunk.is_set():
            first_chunk.set()
            cancelled.wait(30)  # the cancel arrives while this chunk runs
        return run_one(request)

    engine.run_one = spy

    async def main():
        task = asyncio.ensure_future(gen.acall(long_prompt, max_tokens=5))
        await until(first_chunk.is_set, "the long prompt's first chunk")
        other = asyncio.ensure_future(gen.acall("Hello", max_tokens=20))
        task.cancel()
        await until(lambda: any(c.cancelled for c in engine.table.calls.values()), "the cancel to reach the engine")
        cancelled.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await other

    same_as_alone(asyncio.run(main()), alone)
    assert widths.count(16) == 1  # the prompt's first chunk only: never forwarded again
    assert not engine.table.calls and not engine.table.waiting


def test_calls_past_max_rows_wait_for_room_and_a_call_that_never_fits_is_refused(hf_model, tokenizer):
    per_token = models.transformers(hf_model, tokenizer).engine.token_bytes  # KV bytes of one token of one row
    assert per_token > 0
    model = models.transformers(hf_model, tokenizer, max_rows=2, max_kv=100 * per_token)
    gen = continuous(generate.text(model))
    prompts = ["Lima is", "Oslo is", "Kyoto is", "Perth is"]
    alone = [gen(p, max_tokens=8) for p in prompts]
    widest, run_joint = [], model.engine.run_joint

    def spy(requests):
        widest.append(sum(r.batch_rows for r in requests))
        return run_joint(requests)

    model.engine.run_joint = spy

    async def main():
        return await asyncio.gather(*[gen.acall(p, max_tokens=8) for p in prompts])

    for a, b in zip(alone, asyncio.run(main())):
        same_as_alone(a, b)
    assert widest and max(widest) == 2  # merged, never more than two rows at once
    with pytest.raises(ValueError, match="max_rows=2"):
        gen(["a", "b", "c"], max_tokens=2)
    with pytest.raises(ValueError, match=f"max_kv={100 * per_token}"):
        gen("Lima is", max_tokens=400)
    with pytest.raises(ValueError, match="max_rows must be a positive int"):
        models.transformers(hf_model, tokenizer, max_rows=0)
    assert models.transformers(hf_model, tokenizer, max_kv="2MB").engine.table.max_kv == parse_bytes("2MB")


def test_a_stream_dropped_unfinished_is_cancelled_and_leaves_the_engine(model):
    import gc

    gen = continuous(generate.text(model))
    stream = gen.stream("Once upon a time", max_tokens=50)
    next(stream)
    call = stream._call
    assert call.id in model.engine.table.calls  # parked: its consumer holds a piece
    del stream
    gc.collect()
    assert call.cancelled  # nobody will read it: it ends at the engine's next step
    model.engine.close(call)
    assert call.done and call.id not in model.engine.table.calls


_ALONE = {}  # the calls of _calls, each run alone once per model


def _flat(piece) -> list[str]:
    """A piece's text per row (a piece is a str, or a list per prompt, or of lists per sample)."""
    return [piece] if isinstance(piece, str) else [t for p in piece for t in _flat(p)]


def _joined(taken: list[list[str]]) -> list[str] | None:
    """Each row's text of the pieces taken (``_flat`` of each), ``None`` when none was."""
    return ["".join(row) for row in zip(*taken)] if taken else None


async def _closed_after(gen, prompt, kwargs: dict, pieces: int):
    """``gen.astream(prompt, **kwargs)`` closed once its consumer took ``pieces`` pieces: its state,
    and each row's text of the pieces taken."""
    stream = gen.astream(prompt, **kwargs)
    taken = []
    async for piece in stream:
        taken.append(_flat(piece))
        if len(taken) == pieces:
            await stream.aclose()
            break
    return stream.state, _joined(taken)


async def _cancelled_after(gen, prompt, kwargs: dict, pieces: int):
    """``gen.astream(prompt, **kwargs)`` read by a task cancelled once the piece after its
    ``pieces``-th is on its way (made, not yet taken): the stream's state, and each row's text of
    the pieces taken."""
    stream = gen.astream(prompt, **kwargs)
    taken, enough = [], asyncio.Event()

    async def read():
        async for piece in stream:
            taken.append(_flat(piece))
            if len(taken) == pieces:
                enough.set()  # and it asks for the next one
        enough.set()

    task = asyncio.ensure_future(read())
    await enough.wait()
    call = stream._stream._call
    while not (call.events or call.done):  # the engine steps the call to its next piece
        await asyncio.sleep(0.001)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return stream.state, _joined(taken)


_HOW = st.sampled_from(["acall", "stream", "closed", "cancelled"])  # how its consumer takes the call


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 11), _HOW, st.integers(1, 4)), min_size=2, max_size=6))
def test_any_mix_of_calls_and_of_streams_read_closed_or_cancelled_each_equals_its_call_alone(model, mix):
    calls = _calls(model)
    alone = _ALONE.setdefault(id(model), {})
    for i, *_ in mix:
        if i not in alone:
            alone[i] = _run(calls[i])

    async def main():
        jobs = []
        for i, how, pieces in mix:
            _, gen, prompt, kwargs = calls[i]
            jobs.append(gen.acall(prompt, **kwargs) if how == "acall" else drained(gen, prompt, kwargs)
                        if how == "stream" else (_closed_after if how == "closed" else _cancelled_after)(
                            gen, prompt, kwargs, pieces))
        return await asyncio.gather(*jobs)

    for (i, how, _), got in zip(mix, asyncio.run(main())):
        if how in ("acall", "stream"):
            same_as_alone(alone[i], got)
        else:  # what its consumer saw: each row's text holds the pieces it took and begins the text alone
            state, seen = got
            assert all(alone_row.startswith(row) for row, alone_row in zip(state, alone[i]))
            if seen is not None:
                # No more than it saw, but text held back from the pieces (what may still become a
                # stop string or a banned phrase), and a character the last piece left incomplete (U+FFFD).
                held = calls[i][0] in ("stop", "ban")
                assert all(text in row if held else row.rstrip("\ufffd").endswith(text)
                           for row, text in zip(state, seen))
    engine = model.engine
    assert not engine.table.calls and not engine.table.waiting
    assert model.stats.rows_in_use == model.stats.kv_bytes_in_use == 0
