"""The server's agent fields: ``tools`` and ``tool_choice`` (calls in ``message.tool_calls``), and
``reasoning_content`` from a server started with ``--think``."""

from __future__ import annotations

import json

import pytest
from support.serving import NAME, TEMPLATE, save_chat_model, start, stop

from continuous import Think, chat, continuous, generate, models

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 6}, "days": {"enum": [1, 2, 3]}},
    "required": ["city", "days"]}}}
TIME = {"type": "function", "function": {"name": "time", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}, "required": ["city"]}}}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


def _checked(call) -> dict:
    """A call's arguments, checked against its tool's schema (as a strict client would)."""
    import jsonschema

    tool = {"weather": WEATHER, "time": TIME}[call.function.name]
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, tool["function"]["parameters"])
    assert call.type == "function" and call.id.startswith("call_")
    return arguments


def test_a_required_call_names_a_tool_and_its_arguments_fit_the_schema(server):
    answer = server.client().chat.completions.create(model=NAME, messages=MESSAGES, tools=[WEATHER, TIME],
                                                     tool_choice="required", max_tokens=60, temperature=0, n=2)
    for choice in answer.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        for call in choice.message.tool_calls:
            _checked(call)


def test_a_named_tool_choice_calls_that_tool(server):
    answer = server.client().chat.completions.create(
        model=NAME, messages=MESSAGES, tools=[WEATHER, TIME], max_tokens=60, temperature=0,
        tool_choice={"type": "function", "function": {"name": "time"}})
    calls = answer.choices[0].message.tool_calls
    assert calls and all(c.function.name == "time" for c in calls)
    assert "city" in _checked(calls[0])


def test_the_server_answers_as_the_library_s_tools_generator(server, local):
    answer = server.client().chat.completions.create(model=NAME, messages=MESSAGES, tools=[WEATHER],
                                                     tool_choice="auto", max_tokens=40, temperature=0)
    gen = generate.tools(local, [WEATHER], "auto")
    reply = continuous(gen)(gen.prompt(MESSAGES), max_tokens=40).value
    message = answer.choices[0].message
    assert (message.content or "") == reply.text
    assert [json.loads(c.function.arguments) for c in message.tool_calls or []] == [c.arguments for c in reply.calls]


def test_a_streamed_reply_gives_its_calls_as_deltas(server):
    chunks = list(server.client().chat.completions.create(
        model=NAME, messages=MESSAGES, tools=[WEATHER], tool_choice="required", max_tokens=60, temperature=0,
        stream=True))
    deltas = [call for chunk in chunks for c in chunk.choices for call in (c.delta.tool_calls or [])]
    first = [d for d in deltas if d.id is not None]  # each call's id and name come first, once
    assert first and [d.index for d in first] == list(range(len(first)))
    assert all(d.function.name == "weather" and d.type == "function" for d in first)
    import jsonschema

    for i in range(len(first)):  # the arguments, added up, fit the schema
        arguments = json.loads("".join(d.function.arguments or "" for d in deltas if d.index == i))
        jsonschema.validate(arguments, WEATHER["function"]["parameters"])
    assert [c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason] == ["tool_calls"]


def test_tool_choice_without_tools_and_bad_tools_are_refused(server):
    import openai

    client = server.client()
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=NAME, messages=MESSAGES, tool_choice="required", max_tokens=4)
    assert refused.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=NAME, messages=MESSAGES, tools=[WEATHER], tool_choice="date",
                                       max_tokens=4)
    assert refused.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=NAME, messages=MESSAGES, tools=[{"type": "function"}], max_tokens=4)
    assert refused.value.body["param"] == "tools"
    assert client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=2).choices  # still serving


THINKING = TEMPLATE + "{# thinks in <think> and </think> #}"


@pytest.fixture(scope="module")
def thinking_server(request, tmp_path_factory):
    path = save_chat_model(tmp_path_factory.mktemp("think-model") / "tiny", "tiny", 512)
    (path / "chat_template.jinja").write_text(THINKING)
    server = start(path, tmp_path_factory.mktemp("think-log") / "server.log", "--dtype", "float32",
                   "--think", "6")
    request.addfinalizer(lambda: stop(server.pid))
    return server, path


def _reasoning(message):
    """``reasoning_content``, a field the openai client keeps among a message's extras."""
    return (message.model_extra or {}).get("reasoning_content")


def test_a_thinking_server_gives_the_thinking_apart_from_the_answer(thinking_server):
    server, path = thinking_server
    client = server.client()
    answer = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=20, temperature=0)
    message = answer.choices[0].message
    local = models.transformers(str(path), dtype="float32")
    gen = continuous(generate.text(local, think=Think("<think>", "</think>", budget=6)))
    state = gen(chat.prompt(local, MESSAGES), max_tokens=20)
    assert _reasoning(message) == state.reasoning[0]
    assert message.content == state.value
    chunks = list(client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=20, temperature=0,
                                                 stream=True))
    deltas = [c.delta for chunk in chunks for c in chunk.choices]
    assert "".join(_reasoning(d) or "" for d in deltas) == _reasoning(message)
    assert "".join(d.content or "" for d in deltas) == message.content


def test_a_server_cannot_think_without_markers(tmp_path):
    from continuous.serve.app import build_app

    path = save_chat_model(tmp_path / "tiny", "tiny", 512)
    with pytest.raises(ValueError, match="markers"):
        build_app(models.transformers(str(path), dtype="float32"), name=NAME, think=True)
