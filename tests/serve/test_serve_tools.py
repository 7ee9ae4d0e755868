"""Tool calls through the server in this process, driven by the official ``openai`` client:
each choice read alone, ``parallel_tool_calls``, ``tool_choice``'s forms, and calls streamed
as deltas that add up to the whole answer."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest
from support.asgi import async_client, sync_client
from support.constraints import accepts
from support.serving import NAME

from continuous.serve.app import build_app

WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 6}, "days": {"enum": [1, 2, 3]}},
    "required": ["city", "days"]}}}
TIME = {"type": "function", "function": {"name": "time", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}, "required": ["city"]}}}
TOOLS = {"weather": WEATHER, "time": TIME}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
ONE = '<tool_call>{"name": "weather", "arguments": {"city": "Oslo", "days": 1}}</tool_call>'


@pytest.fixture(scope="module")
def app(local):
    return build_app(local, name=NAME)


def ask(app, **request):
    """A whole answer, through the sync client."""
    return sync_client(app).chat.completions.create(model=NAME, messages=MESSAGES, **request)


def streamed(app, **request) -> list:
    """A streamed answer's chunks, through the async client."""
    async def chunks():
        stream = await async_client(app).chat.completions.create(model=NAME, messages=MESSAGES, stream=True,
                                                                  **request)
        return [chunk async for chunk in stream]

    return asyncio.run(chunks())


def whole(answer) -> dict:
    """Each choice's content, calls (name, arguments) and finish reason."""
    return {c.index: (c.message.content or "", [(t.function.name, t.function.arguments)
                                                 for t in c.message.tool_calls or []], c.finish_reason)
            for c in answer.choices}


def rebuilt(chunks) -> dict:
    """The same, added up from a stream's deltas as clients do; each call's id, type and name come
    in its first delta (with its index), its arguments after, in pieces."""
    rows: dict = {}
    for chunk in chunks:
        for c in chunk.choices:
            row = rows.setdefault(c.index, {"content": "", "calls": [], "finish": None})
            row["content"] += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                if d.id is not None:  # a new call, in order
                    assert d.index == len(row["calls"]) and d.type == "function" and d.function.name
                    row["calls"].append([d.function.name, d.function.arguments or ""])
                else:  # more of its arguments, and nothing else
                    assert d.index < len(row["calls"]) and d.function.name is None and d.type is None
                    row["calls"][d.index][1] += d.function.arguments
            row["finish"] = c.finish_reason or row["finish"]
    return {i: (row["content"], [tuple(call) for call in row["calls"]], row["finish"]) for i, row in rows.items()}


def checked(name: str, arguments: str) -> dict:
    """A call's arguments, checked against its tool's schema (as a strict client would)."""
    parsed = json.loads(arguments)
    jsonschema.validate(parsed, TOOLS[name]["function"]["parameters"])
    return parsed


def call_ends(answer) -> list[int]:
    """Per choice, how many tokens its first call took to end (its closing marker included)."""
    ends = []
    for choice in answer.choices:
        tokens = [t.token for t in choice.logprobs.content]
        ends.append(next(k for k in range(1, len(tokens) + 1) if "</tool_call>" in "".join(tokens[:k])))
    return ends


def test_each_choice_stands_alone_when_another_is_cut_inside_its_call(app):
    request = dict(tools=[WEATHER], tool_choice="required", n=4, temperature=1)
    seed, ends = next((seed, ends) for seed in range(20)
                      if len(set(ends := call_ends(ask(app, **request, seed=seed, max_tokens=80, logprobs=True)))) > 1)
    cut = min(ends)  # the rows whose call ends there end it; the others are cut inside theirs
    answer = ask(app, **request, seed=seed, max_tokens=cut)
    longer = whole(ask(app, **request, seed=seed, max_tokens=80))
    for choice, end in zip(answer.choices, ends):
        message = choice.message
        assert "<tool_call>" not in (message.content or "")
        if end == cut:
            assert choice.finish_reason == "tool_calls" and len(message.tool_calls) == 1
            assert checked(message.tool_calls[0].function.name, message.tool_calls[0].function.arguments)
        else:  # the call as far as written, as OpenAI gives a call cut by max_tokens
            assert choice.finish_reason == "length"
            for call, (name, arguments) in zip(message.tool_calls or [], longer[choice.index][1]):
                assert call.function.name == name and arguments.startswith(call.function.arguments)
    assert rebuilt(streamed(app, **request, seed=seed, max_tokens=cut)) == whole(answer)


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_streamed_calls_are_deltas_that_add_up_to_the_whole_answer(app, choice):
    request = dict(tools=[WEATHER, TIME], tool_choice=choice, n=3, temperature=1, seed=5, max_tokens=80)
    chunks = streamed(app, **request)
    answer = whole(ask(app, **request))
    assert rebuilt(chunks) == answer
    pieces = [d for chunk in chunks for c in chunk.choices for d in c.delta.tool_calls or [] if d.id is None]
    if choice == "required":
        assert all(calls and finish == "tool_calls" for _, calls, finish in answer.values())
        assert len(pieces) > 3 * 2  # the arguments came as they were written, not whole at the end
        for _, calls, _ in answer.values():
            checked(*calls[0])


def test_the_sync_client_and_its_stream_helper_see_the_same_calls(app):
    request = dict(tools=[WEATHER, TIME], tool_choice="required", temperature=1, seed=2, max_tokens=80)
    client = sync_client(app)
    chunks = list(client.chat.completions.create(model=NAME, messages=MESSAGES, stream=True, **request))
    answer = whole(ask(app, **request))
    assert rebuilt(chunks) == answer
    with client.chat.completions.stream(model=NAME, messages=MESSAGES, **request) as stream:
        final = stream.get_final_completion()
    assert [(t.function.name, t.function.arguments) for t in final.choices[0].message.tool_calls] == answer[0][1]


def test_parallel_tool_calls_false_reaches_the_grammar(app, monkeypatch):
    served, used = app.state.served, []
    build = served.tools_generator
    monkeypatch.setattr(served, "tools_generator", lambda *args: used.append(build(*args)) or used[-1])
    answer = ask(app, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, n=3, temperature=1,
                 seed=0, max_tokens=60)
    assert all(len(c.message.tool_calls or []) <= 1 for c in answer.choices)
    ask(app, tools=[WEATHER], tool_choice="required", n=3, max_tokens=1)
    one_only, parallel = (gen.generator for gen in used)
    assert accepts(one_only, ONE + " ok") and not accepts(one_only, ONE + ONE)
    assert accepts(parallel, ONE + ONE)


def test_a_tool_choice_object_names_its_tool_in_either_form(app):
    for form in ({"type": "function", "function": {"name": "time"}}, {"type": "function", "name": "time"}):
        answer = ask(app, tools=[WEATHER, TIME], tool_choice=form, n=3, temperature=1, seed=1, max_tokens=40)
        for choice in answer.choices:
            calls = choice.message.tool_calls
            assert calls and all(c.function.name == "time" for c in calls)


@pytest.mark.parametrize("tool_choice", [
    {"type": "function"}, {"type": "function", "function": {}}, {"type": "function", "function": {"name": 3}},
    {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}},
    {"type": "function", "name": "date"}, {"type": "function", "function": {"name": "date"}}, "date"])
def test_a_tool_choice_that_names_no_tool_of_the_request_is_refused(app, tool_choice):
    with pytest.raises(openai.BadRequestError) as refused:
        ask(app, tools=[WEATHER, TIME], tool_choice=tool_choice, max_tokens=4)
    assert refused.value.status_code == 400
    assert refused.value.body["param"] == "tool_choice" and refused.value.body["code"] == "invalid_value"


@pytest.mark.slow
@pytest.mark.real
def test_smollm2_streams_the_calls_it_answers_whole():
    from support.real import smollm2

    from continuous import models

    app = build_app(models.transformers(str(smollm2())), name=NAME)
    request = dict(messages=[{"role": "user", "content": "What time is it in Oslo, and the weather in Paris?"}],
                   tools=[WEATHER, TIME], tool_choice="required", n=2, temperature=0.7, seed=4, max_tokens=40)
    answer = whole(sync_client(app).chat.completions.create(model=NAME, **request))

    async def chunks():
        stream = await async_client(app).chat.completions.create(model=NAME, stream=True, **request)
        return [chunk async for chunk in stream]

    assert rebuilt(asyncio.run(chunks())) == answer
    for content, calls, finish in answer.values():
        assert calls and finish == "tool_calls" and "<tool_call>" not in content
        checked(*calls[0])
