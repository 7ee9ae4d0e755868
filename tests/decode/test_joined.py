"""Calls that start together are stepped as one table of rows, and each equals the call alone."""

import asyncio

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel
from support.states import same_as_alone

from continuous import continuous, generate
from continuous.decode import joined

PROMPTS = ["Hi", "User: tell me about Lima.\nAssistant:", "Once upon a time there was", "A city:",
           "The capital of France is", "Code:"]


class City(BaseModel):
    name: str
    population: int


_BANNED = {}


def _banned(model) -> list[str]:
    """Words the model writes after the prompts when free: banned, its rows rewind."""
    if id(model) not in _BANNED:
        free = continuous(generate.text(model))
        words = {w for p in PROMPTS for w in free(p, max_tokens=20).value.split() if len(w) >= 3}
        _BANNED[id(model)] = sorted(words)[:8]
    return _BANNED[id(model)]


def _generators(model):
    return {"text": continuous(generate.text(model)), "json": continuous(generate.json(model, City)),
            "regex": continuous(generate.regex(model, r"[0-9]{2,5}-[a-z]{2,6}")),
            "ban": continuous(generate.text(model, ban=_banned(model)))}


@pytest.fixture
def tables(monkeypatch):
    """The sizes of the tables seated while the test runs (calls per table)."""
    seated = []
    made = joined.Joined.steps_of

    def spy(decodings, seats):
        seated.append(len(decodings))
        return made(decodings, seats)

    monkeypatch.setattr(joined.Joined, "steps_of", staticmethod(spy))
    return seated


def _clean(model):
    engine = model.engine
    assert not engine.table.calls and not engine.table.waiting
    assert model.stats.rows_in_use == model.stats.kv_bytes_in_use == 0


async def _together(gen, calls):
    return await asyncio.gather(*[gen.acall(prompt, **kwargs) for prompt, kwargs in calls])


_SAMPLING = st.sampled_from([{}, dict(temperature=0.8, seed=7), dict(top_p=0.9, seed=3, logprobs=2), dict(logprobs=0)])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(["text", "json", "regex", "ban"]), _SAMPLING,
       st.lists(st.tuples(st.sampled_from(PROMPTS), st.integers(1, 14)), min_size=2, max_size=6))
def test_calls_that_start_together_are_one_table_and_each_equals_the_call_alone(model, tables, kind, sampling, mix):
    gen = _generators(model)[kind]
    calls = [(prompt, dict(sampling, max_tokens=n)) for prompt, n in mix]
    alone = [gen(prompt, **kwargs) for prompt, kwargs in calls]
    tables.clear()
    model.stats.reset()
    together = asyncio.run(_together(gen, calls))
    assert tables == [len(calls)]  # one table for all: same generator and options, max_tokens aside
    for a, b in zip(alone, together):
        same_as_alone(a, b)
    _clean(model)


def test_a_call_that_left_the_table_early_continues_as_the_same_call_alone(model, tables):
    gen = _generators(model)["text"]
    calls = [("Hi", dict(max_tokens=2)), ("Once upon a time there was", dict(max_tokens=12)),
             ("A city:", dict(max_tokens=5))]
    together = asyncio.run(_together(gen, calls))
    assert tables == [3]
    for (prompt, kwargs), state in zip(calls, together):
        alone = gen(prompt, **kwargs)
        same_as_alone(alone, state)
        # Its cache holds its own slots only (the table's other prompts' slots left out), in order.
        assert state.cache_bytes <= alone.cache_bytes
        same_as_alone(gen(alone, max_tokens=6), gen(state, max_tokens=6))
    _clean(model)


def test_rows_that_rewind_in_a_table_equal_the_call_alone_and_keep_no_hole(model, tables):
    gen = _generators(model)["ban"]
    calls = [(prompt, dict(max_tokens=20)) for prompt in PROMPTS]
    model.stats.reset()
    alone = [gen(prompt, **kwargs) for prompt, kwargs in calls]
    assert model.stats.tokens_rewound > 0
    together = asyncio.run(_together(gen, calls))
    assert tables == [len(calls)]
    for state, want in zip(together, alone):
        same_as_alone(want, state)
        assert bool(state.attention_mask.all())  # one row each, and no slot a rewind took back
        same_as_alone(gen(want, max_tokens=6), gen(state, max_tokens=6))
    _clean(model)


def test_a_guest_cancelled_ends_within_a_step_and_the_others_equal_the_calls_alone(model, tables):
    gen = _generators(model)["text"]
    long = ("Once upon a time there was", dict(max_tokens=40))
    calls = [("Hi", dict(max_tokens=30)), long, ("A city:", dict(max_tokens=30))]
    alone = [gen(prompt, **kwargs) for prompt, kwargs in calls]

    async def main():
        tasks = [asyncio.ensure_future(gen.acall(prompt, **kwargs)) for prompt, kwargs in calls]
        engine = model.engine
        while True:
            with engine.cond:  # the engine thread changes its table meanwhile
                if any(c.guests for c in engine.table.calls.values()):
                    break
            await asyncio.sleep(0.001)
        steps = model.stats.steps
        tasks[1].cancel()
        with pytest.raises(asyncio.CancelledError):
            await tasks[1]
        left_within = model.stats.steps - steps
        return left_within, await asyncio.gather(tasks[0], tasks[2])

    left_within, (first, third) = asyncio.run(main())
    assert tables == [3]
    assert left_within <= 1
    same_as_alone(alone[0], first)
    same_as_alone(alone[2], third)
    _clean(model)


def test_a_failing_table_step_fails_its_calls_and_the_model_goes_on(model, tables, monkeypatch):
    gen = _generators(model)["json"]
    calls = [("A city:", dict(max_tokens=20)), ("Hi", dict(max_tokens=20))]
    expected = [gen(prompt, **kwargs) for prompt, kwargs in calls]
    forwards, run_one = [0], model.engine.run_one

    def failing(request):
        forwards[0] += 1
        if forwards[0] == 4:  # a decode step of the table
            raise RuntimeError("device lost")
        return run_one(request)

    monkeypatch.setattr(model.engine, "run_one", failing)
    monkeypatch.setattr(model.engine, "run_joint", None)  # every forward runs through run_one

    async def main():
        return await asyncio.gather(*[gen.acall(p, **k) for p, k in calls], return_exceptions=True)

    results = asyncio.run(main())
    assert tables == [2]
    assert all(isinstance(r, RuntimeError) and "device lost" in str(r) for r in results)
    _clean(model)
    monkeypatch.undo()
    for (prompt, kwargs), want in zip(calls, expected):
        same_as_alone(want, gen(prompt, **kwargs))


def test_streams_and_calls_of_other_options_are_not_seated_together(model, tables):
    gen = _generators(model)["text"]

    async def main():
        async def read(prompt):
            return [piece async for piece in gen.astream(prompt, max_tokens=6)]

        return await asyncio.gather(read("Hi"), read("A city:"), gen.acall("Hi", max_tokens=6),
                                    gen.acall("A city:", max_tokens=6, stop_at=["."]),
                                    gen.acall("Code:", max_tokens=6, temperature=0.7, seed=1))

    asyncio.run(main())
    assert tables == []  # streams step alone, and no two calls share their options
    _clean(model)


def test_a_table_beside_a_stream_shares_its_forwards_and_each_equals_the_call_alone(model, tables):
    gen = _generators(model)["json"]
    text = _generators(model)["text"]
    calls = [("Hi", dict(max_tokens=6)), ("A city:", dict(max_tokens=15)), ("Code:", dict(max_tokens=10))]
    alone = [gen(prompt, **kwargs) for prompt, kwargs in calls]
    streamed_alone = text("Once upon a time there was", max_tokens=20)

    async def main():
        async def read():
            stream = text.astream("Once upon a time there was", max_tokens=20)
            async for _ in stream:
                pass
            return stream.state

        return await asyncio.gather(read(), *[gen.acall(prompt, **kwargs) for prompt, kwargs in calls])

    model.stats.reset()
    streamed, *together = asyncio.run(main())
    assert tables == [3]
    assert model.stats.forward_calls < 20 + 15  # the table's steps and the stream's are merged forwards
    same_as_alone(streamed_alone, streamed)
    for want, got in zip(alone, together):
        same_as_alone(want, got)
    _clean(model)
