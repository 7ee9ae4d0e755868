"""Streams keep their state, and the async forms of a call and a stream."""

import asyncio

import pytest
from support.waiting import until

from continuous import continuous, generate
from continuous.decode import Decoding
from continuous.state import SequenceState


@pytest.fixture(scope="module")
def gen(model):
    return continuous(generate.text(model))


def test_the_state_after_a_break_holds_what_was_streamed(model, gen):
    prompt = gen("Once upon a time", max_tokens=0)
    stream = gen.stream(prompt, max_tokens=20)
    pieces = []
    for piece in stream:
        pieces.append(piece)
        if len(pieces) == 4:
            break
    state = stream.state
    assert isinstance(state, SequenceState)
    assert str(state) == str(prompt) + "".join(pieces)
    # The cache covers all but the newest token: going on forwards only that one and the new ones.
    before = model.stats.tokens_forwarded
    more = gen(state, max_tokens=6)
    assert model.stats.tokens_forwarded - before == 1 + 6 - 1
    assert str(more) == str(gen(prompt, max_tokens=10))


def test_close_keeps_the_state_and_ends_the_iteration(gen):
    stream = gen.stream("The dog", max_tokens=30)
    first = next(stream)
    stream.close()
    assert str(stream.state) == "The dog" + first
    with pytest.raises(StopIteration):
        next(stream)
    assert str(gen(stream.state, max_tokens=3)) == str(gen("The dog", max_tokens=4))


def test_the_final_state_is_the_stream_s_state_and_its_return_value(gen):
    stream = gen.stream(["a b", "c"], max_tokens=5)
    pieces = list(stream)
    final = stream.state
    assert [str(t) for t in final] == [p + "".join(x[r] for x in pieces) for r, p in enumerate(["a b", "c"])]
    assert list(final) == list(gen(["a b", "c"], max_tokens=5))
    with pytest.raises(StopIteration) as done:
        next(stream)
    assert done.value.value is final


def test_the_state_before_the_first_piece_is_the_prefilled_input(model, gen):
    stream = gen.stream("Hello there", max_tokens=5)
    start = stream.state
    assert str(start) == "Hello there"
    assert int(start.cached_lengths[0]) == len(start.token_ids[0])  # prefilled: nothing left to forward
    assert "".join(stream) == str(gen("Hello there", max_tokens=5))[len("Hello there"):]


def test_a_stream_with_a_constraint_gives_a_state_whose_value_says_cut_short(model):
    gen = continuous(generate.json(model, {"type": "object", "properties": {"a": {"type": "integer"}}}))
    stream = gen.stream("JSON:", max_tokens=40)
    next(stream)
    stream.close()
    with pytest.raises(ValueError, match="cut short"):
        stream.state.value
    assert stream.state.finish_reasons == [None]


def test_acall_and_astream_give_what_the_sync_forms_give(gen):
    async def main():
        state = await gen.acall(["one", "two"], max_tokens=6)
        stream = gen.astream("three", max_tokens=6)
        pieces = [p async for p in stream]
        return state, pieces, stream.state

    state, pieces, final = asyncio.run(main())
    assert list(state) == list(gen(["one", "two"], max_tokens=6))
    assert "three" + "".join(pieces) == str(final) == str(gen("three", max_tokens=6))


def test_a_cancelled_call_leaves_its_input_usable(model, gen):
    prompt = gen("A long story:", max_tokens=2)
    expected = str(gen(prompt, max_tokens=5))

    async def main():
        task = asyncio.create_task(gen.acall(prompt, max_tokens=400))
        await until(lambda: model.stats.forward_calls > calls, "the call's first forward")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await until(lambda: model.engine.running() == 0, "the cancelled call to leave the engine")

    calls = model.stats.forward_calls
    asyncio.run(main())
    assert str(gen(prompt, max_tokens=5)) == expected


def test_breaking_an_async_stream_keeps_its_state(gen):
    async def main():
        stream = gen.astream("Tell me", max_tokens=20)
        got = []
        async for piece in stream:
            got.append(piece)
            if len(got) == 3:
                break
        await stream.aclose()
        return got, stream.state

    got, state = asyncio.run(main())
    assert str(state) == "Tell me" + "".join(got)
    assert str(gen(state, max_tokens=2)) == str(gen("Tell me", max_tokens=5))


def test_stream_arguments_are_checked_when_called(gen):
    with pytest.raises(ValueError, match="max_tokens"):
        gen.astream("a", max_tokens=-1)
    with pytest.raises(TypeError):
        gen.stream("a", temprature=0.5)


def test_a_stream_closed_before_it_starts_generates_nothing(gen):
    stream = gen.stream("Quiet", max_tokens=5)
    stream.close()
    assert list(stream) == [] and str(stream.state) == "Quiet"


def test_a_cancelled_async_for_keeps_only_what_it_yielded(model, gen):
    async def main():
        stream = gen.astream("A long story:", max_tokens=400)
        got = []

        async def consume():
            async for piece in stream:
                got.append(piece)

        task = asyncio.create_task(consume())
        await until(lambda: len(got) >= 3, "three pieces")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return got, stream.state

    got, state = asyncio.run(main())
    assert str(state) == "A long story:" + "".join(got)


def test_a_stream_read_without_snapshots_gives_the_same_pieces_and_final_state(gen, monkeypatch):
    """A consumer that drops the state of a stream it cancels (the server) reads the same pieces and
    final state, with nothing of what it has seen taken at each step."""
    results = []
    real = Decoding.seen
    monkeypatch.setattr(Decoding, "seen", lambda self: results.append(self) or real(self))

    async def read(stream):
        return [piece async for piece in stream], stream.state

    kept, kept_state = asyncio.run(read(gen.astream("Tell me", max_tokens=12)))
    with_snapshots, results[:] = len(results), []
    plain, plain_state = asyncio.run(read(gen.astream("Tell me", max_tokens=12)._no_snapshots()))
    assert plain == kept and str(plain_state) == str(kept_state)
    assert len(results) == 1 < len(kept) <= with_snapshots  # the final state's only


def test_a_healed_stream_closed_before_its_first_piece_has_an_empty_value(gen):
    stream = gen.stream("Visit https://www.exa", heal=True, max_tokens=5)
    stream.close()
    assert stream.state.value == "" == gen("Visit https://www.exa", heal=True, max_tokens=0).value
    assert str(stream.state) == "Visit https://www.exa"


def test_a_model_without_an_engine_runs_each_call_alone_in_the_sync_and_async_forms(hf_model, tokenizer, gen):
    from concurrent.futures import ThreadPoolExecutor

    from continuous import models

    from continuous.models.scheduler import Request

    alone = models.transformers(hf_model, tokenizer, prefill_chunk=77)  # a wrapper of its own
    direct = alone.engine.forward
    alone.forward = lambda ids, mask, cache, keep=1, n_real=None, holes=True: direct(  # noqa: E731
        Request(ids, mask, cache, logits_to_keep=keep, n_real=n_real, holes=holes))
    alone.engine, alone.executor = None, ThreadPoolExecutor(4)  # as a swarm's model: one loop per call
    lone = continuous(generate.text(alone))
    expected = [str(gen(p, max_tokens=6)) for p in ("one", "two", "three")]

    async def main():
        called = await asyncio.gather(lone.acall("one", max_tokens=6), lone.acall("two", max_tokens=6))
        stream = lone.astream("three", max_tokens=6)
        pieces = [p async for p in stream]
        return [str(s) for s in called] + ["three" + "".join(pieces)]

    assert asyncio.run(main()) == expected
    assert str(lone("one", max_tokens=6)) == expected[0]
    stream = lone.stream("two", max_tokens=6)
    first = next(stream)
    stream.close()
    assert str(stream.state) == "two" + first


def test_the_time_of_the_first_piece_is_kept_for_streams_and_whole_calls(gen):
    import time

    before = time.monotonic()
    stream = gen.stream("Once", max_tokens=4)
    assert stream.first_piece_at is None
    next(stream)
    assert before <= stream.first_piece_at <= time.monotonic()

    async def main():
        whole = gen.astream("Twice", max_tokens=4)
        await whole.run()
        return whole.first_piece_at

    assert before <= asyncio.run(main()) <= time.monotonic()
