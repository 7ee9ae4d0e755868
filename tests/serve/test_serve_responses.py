"""``/v1/responses`` through the official ``openai`` client, in this process: the same answers as
the chat endpoint's for the same messages, formats and tools held, events in order, errors OpenAI's."""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import jsonschema
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, Field
from starlette.testclient import TestClient
from support.serving import NAME, TEMPLATE, save_chat_model

from continuous import models
from continuous.serve import build_app

pytestmark = pytest.mark.timeout(600)

WEATHER = {"type": "function", "name": "weather", "strict": True, "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 6}, "days": {"enum": [1, 2, 3]}},
    "required": ["city", "days"], "additionalProperties": False}}
TIME = {"type": "function", "name": "time", "strict": True, "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}, "required": ["city"],
    "additionalProperties": False}}
SCHEMAS = {tool["name"]: tool["parameters"] for tool in (WEATHER, TIME)}
QUESTION = "Tell me about Alice."
INSTRUCTIONS = "Be brief."


def _as_chat(tool: dict) -> dict:
    return {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}


@pytest.fixture(scope="module")
def app(chat_model_dir):
    """The tiny model with a prefix cache, served in this process."""
    return build_app(models.transformers(str(chat_model_dir), dtype="float32", prefix_cache="64MB"), name=NAME)


@pytest.fixture(scope="module")
def client(app):
    with TestClient(app) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0)


def _chat(client, messages, **options):
    return client.chat.completions.create(model=NAME, messages=messages, **options)


def test_text_is_the_chat_endpoint_s_for_the_same_messages(client):
    response = client.responses.create(model=NAME, input=QUESTION, instructions=INSTRUCTIONS,
                                       max_output_tokens=12, temperature=0)
    answer = _chat(client, [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}],
                   max_tokens=12, temperature=0)
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant"
    assert response.output_text == answer.choices[0].message.content
    assert response.usage.input_tokens == answer.usage.prompt_tokens
    assert response.usage.output_tokens == answer.usage.completion_tokens == 12
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    # twelve tokens is the limit: the response says it was cut there
    assert answer.choices[0].finish_reason == "length"
    assert response.status == message.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.max_output_tokens == 12 and response.instructions == INSTRUCTIONS


def test_a_seed_samples_as_the_chat_endpoint_does(client):
    options = dict(max_output_tokens=10, temperature=1.0, top_p=0.9, extra_body={"seed": 11})
    first = client.responses.create(model=NAME, input=QUESTION, **options)
    again = client.responses.create(model=NAME, input=QUESTION, **options)
    answer = _chat(client, [{"role": "user", "content": QUESTION}], max_tokens=10, temperature=1.0, top_p=0.9,
                   seed=11)
    assert first.output_text == again.output_text == answer.choices[0].message.content


def test_input_items_are_the_messages_they_mean(client):
    items = [{"role": "developer", "content": [{"type": "input_text", "text": "Answer "},
                                               {"type": "input_text", "text": "about pets."}]},
             {"type": "message", "role": "user", "content": "Who has a cat?"},
             {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
              "content": [{"type": "output_text", "text": "Bob.", "annotations": []}]},
             {"role": "user", "content": [{"type": "input_text", "text": "And a dog?"}]}]
    response = client.responses.create(model=NAME, input=items, max_output_tokens=8, temperature=0)
    messages = [{"role": "system", "content": "Answer about pets."}, {"role": "user", "content": "Who has a cat?"},
                {"role": "assistant", "content": "Bob."}, {"role": "user", "content": "And a dog?"}]
    answer = _chat(client, messages, max_tokens=8, temperature=0)
    assert response.output_text == answer.choices[0].message.content
    assert response.usage.input_tokens == answer.usage.prompt_tokens


def test_a_stream_s_events_build_the_whole_response(client):
    options = dict(model=NAME, input=QUESTION, max_output_tokens=16, temperature=0)
    whole = client.responses.create(**options)
    events = list(client.responses.create(stream=True, **options))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * len(deltas),
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     f"response.{whole.status}"]
    assert events[0].response.status == "in_progress" and events[0].response.id == events[-1].response.id
    text = "".join(e.delta for e in deltas)
    done = next(e for e in events if e.type == "response.output_item.done")
    item_id = events[2].item.id
    assert all(e.item_id == item_id for e in deltas) and done.item.id == item_id
    assert text == events[-4].text == done.item.content[0].text == whole.output_text
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens == whole.usage.output_tokens


def test_an_async_client_streams_the_same_text(app):
    import httpx2

    async def run():
        http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://testserver")
        async with openai.AsyncOpenAI(base_url="http://testserver/v1", api_key="none", http_client=http,
                                      max_retries=0) as client:
            whole = await client.responses.create(model=NAME, input=QUESTION, max_output_tokens=8, temperature=0)
            stream = await client.responses.create(model=NAME, input=QUESTION, max_output_tokens=8, temperature=0,
                                                   stream=True)
            text = "".join([e.delta async for e in stream if e.type == "response.output_text.delta"])
            return whole.output_text, text

    whole, streamed = asyncio.run(run())
    assert whole == streamed


class Pet(BaseModel):
    name: str = Field(max_length=8)
    kind: Literal["cat", "dog", "parrot"]
    age: int = Field(ge=0, le=30)


def test_json_schema_output_validates_and_parses(client):
    parsed = client.responses.parse(model=NAME, input=QUESTION, text_format=Pet, max_output_tokens=80,
                                    extra_body={"seed": 3})
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, Pet)
    with client.responses.stream(model=NAME, input=QUESTION, text_format=Pet, max_output_tokens=80,
                                 extra_body={"seed": 3}) as stream:  # the client's own accumulation of events
        assert stream.get_final_response().output_parsed == parsed.output_parsed
    schema = {**Pet.model_json_schema(), "additionalProperties": False}
    fmt = {"type": "json_schema", "name": "pet", "schema": schema, "strict": True}
    for seed in (4, 5):
        response = client.responses.create(model=NAME, input=QUESTION, text={"format": fmt}, max_output_tokens=80,
                                           extra_body={"seed": seed})
        assert response.status == "completed"
        jsonschema.validate(json.loads(response.output_text), schema)
        assert response.text.format.type == "json_schema"
    anything = client.responses.create(model=NAME, input=QUESTION, text={"format": {"type": "json_object"}},
                                       max_output_tokens=80, extra_body={"seed": 6})
    if anything.status == "completed":
        assert isinstance(json.loads(anything.output_text), dict)


def _checked(item) -> dict:
    """A function_call item's arguments, checked against its tool's schema."""
    assert item.type == "function_call" and item.call_id.startswith("call_") and item.status == "completed"
    arguments = json.loads(item.arguments)
    jsonschema.validate(arguments, SCHEMAS[item.name])
    return arguments


def test_required_and_named_tool_choices_return_calls_that_fit_their_schemas(client):
    question = [{"role": "user", "content": "Weather in Paris?"}]
    required = client.responses.create(model=NAME, input=question, tools=[WEATHER, TIME], tool_choice="required",
                                       max_output_tokens=60, temperature=0)
    calls = [item for item in required.output if item.type == "function_call"]
    assert calls and required.status == "completed"
    for call in calls:
        _checked(call)
    named = client.responses.create(model=NAME, input=question, tools=[WEATHER, TIME], max_output_tokens=60,
                                    temperature=0, tool_choice={"type": "function", "name": "time"})
    calls = [item for item in named.output if item.type == "function_call"]
    assert calls and {c.name for c in calls} == {"time"} and "city" in _checked(calls[0])
    none = client.responses.create(model=NAME, input=question, tools=[WEATHER], tool_choice="none",
                                   max_output_tokens=12, temperature=0)
    assert [item.type for item in none.output] == ["message"]


def test_auto_tools_answer_as_the_chat_endpoint_does(client):
    question = [{"role": "user", "content": "Weather in Paris?"}]
    for seed in (1, 2):
        response = client.responses.create(model=NAME, input=question, tools=[WEATHER], max_output_tokens=40,
                                           extra_body={"seed": seed})
        answer = _chat(client, question, tools=[_as_chat(WEATHER)], max_tokens=40, seed=seed)
        message = answer.choices[0].message
        calls = [item for item in response.output if item.type == "function_call"]
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [
            (c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]
        assert response.output_text == (message.content or "")


def test_an_agent_loop_sends_its_calls_and_their_outputs_back(client):
    question = [{"role": "user", "content": "Weather in Paris?"}]
    first = client.responses.create(model=NAME, input=question, tools=[WEATHER], tool_choice="required",
                                    max_output_tokens=60, temperature=0)
    (call,) = [item for item in first.output if item.type == "function_call"][:1]
    items = question + [item.model_dump(exclude_none=True) for item in first.output] + [
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "clear"}'}]
    second = client.responses.create(model=NAME, input=items, tools=[WEATHER], max_output_tokens=20, temperature=0)
    calls = [{"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
             for c in first.output if c.type == "function_call"]
    messages = question + [{"role": "assistant", "content": first.output_text or None, "tool_calls": calls},
                           {"role": "tool", "tool_call_id": call.call_id, "content": '{"sky": "clear"}'}]
    answer = _chat(client, messages, tools=[_as_chat(WEATHER)], max_tokens=20, temperature=0)
    assert second.usage.input_tokens == answer.usage.prompt_tokens
    assert second.output_text == (answer.choices[0].message.content or "")
    # the first turn's prompt, sent again, came from the prefix cache
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens


def test_a_streamed_call_s_events_add_up_to_the_call(client):
    events = list(client.responses.create(model=NAME, input="Weather in Paris?", tools=[WEATHER, TIME],
                                          tool_choice="required", max_output_tokens=60, temperature=0,
                                          stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert events[-1].type == "response.completed"
    calls = [item for item in final.output if item.type == "function_call"]
    assert calls
    for call in calls:
        added = [e for e in events if e.type == "response.output_item.added" and e.item.id == call.id]
        pieces = [e.delta for e in events
                  if e.type == "response.function_call_arguments.delta" and e.item_id == call.id]
        (done,) = [e for e in events if e.type == "response.function_call_arguments.done" and e.item_id == call.id]
        assert len(added) == 1 and added[0].item.call_id == call.call_id and added[0].item.name == call.name
        assert "".join(pieces) == done.arguments == call.arguments
        _checked(call)


THINKING = TEMPLATE + "{# thinks in <think> and </think> #}"


@pytest.fixture(scope="module")
def thinking(tmp_path_factory):
    path = save_chat_model(tmp_path_factory.mktemp("think-model") / "tiny", "tiny", 512)
    (path / "chat_template.jinja").write_text(THINKING)
    app = build_app(models.transformers(str(path), dtype="float32"), name=NAME, think=6)
    with TestClient(app) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0)


def test_a_thinking_model_s_reasoning_is_an_item_of_its_own(thinking):
    response = thinking.responses.create(model=NAME, input=QUESTION, max_output_tokens=20, temperature=0)
    answer = _chat(thinking, [{"role": "user", "content": QUESTION}], max_tokens=20, temperature=0)
    message = answer.choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert reasoning and [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == reasoning
    assert response.output_text == message.content
    assert 0 < response.usage.output_tokens_details.reasoning_tokens < response.usage.output_tokens
    events = list(thinking.responses.create(model=NAME, input=QUESTION, max_output_tokens=20, temperature=0,
                                            stream=True))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == reasoning
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == message.content
    assert [item.type for item in events[-1].response.output] == ["reasoning", "message"]


@pytest.mark.parametrize("request_, param", [
    (dict(previous_response_id="resp_1"), "previous_response_id"),
    (dict(extra_body={"temprature": 1}), "temprature"),
    (dict(max_output_tokens=-1), "max_output_tokens"),
    (dict(tools=[{"type": "web_search"}]), "tools.0.type"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "name": "time"}), "tool_choice.name"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=[WEATHER], text={"format": {"type": "json_object"}}), "text.format"),
    (dict(text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}), "text.format"),
    (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]),
     "input.0.content.0.type"),
    (dict(input=[{"type": "item_reference", "id": "msg_1"}]), "input.0.type"),
    (dict(input=[{"type": "function_call_output", "output": "1"}]), "input.0.call_id"),
])
def test_refusals_name_their_param_and_leave_the_server_serving(client, request_, param):
    request_ = {"model": NAME, "input": QUESTION, "max_output_tokens": 2, **request_}
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(**request_)
    error = refused.value.body
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["code"]
    assert client.responses.create(model=NAME, input=QUESTION, max_output_tokens=2).output_text is not None


def test_another_model_and_a_stored_response_are_not_found(client):
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(model="other", input=QUESTION, max_output_tokens=2)
    assert missing.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.retrieve("resp_1")
    assert "stateless" in missing.value.body["message"]


def test_a_call_failing_mid_stream_ends_it_with_response_failed(app, client, monkeypatch):
    from continuous.serve.calls import Call, Delta

    async def failing(self, stream):
        try:
            async for _ in stream:
                yield [Delta(text="so far")]
                raise RuntimeError("the model broke")
        finally:
            await stream.aclose()

    monkeypatch.setattr(Call, "deltas", failing)
    events = list(client.responses.create(model=NAME, input=QUESTION, max_output_tokens=8, stream=True))
    failed = events[-1]
    assert failed.type == "response.failed" and failed.response.status == "failed"
    assert "the model broke" in failed.response.error.message
    assert failed.response.output[0].content[0].text == "so far"
    monkeypatch.undo()
    assert app.state.served.in_flight == 0  # its queue slot is free: the server goes on serving
    assert client.responses.create(model=NAME, input=QUESTION, max_output_tokens=2).usage.output_tokens == 2


def test_calls_join_the_assistant_turn_before_them_and_reasoning_is_left_out():
    from continuous.serve.responses import messages

    items = [{"role": "user", "content": "Paris and Oslo?"},
             {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Looking."}]},
             {"type": "function_call", "call_id": "a", "name": "weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call", "call_id": "b", "name": "weather", "arguments": '{"city": "Oslo"}'},
             {"type": "function_call_output", "call_id": "a", "output": "sunny"},
             {"type": "function_call_output", "call_id": "b", "output": [{"type": "input_text", "text": "rain"}]},
             {"type": "function_call", "call_id": "c", "name": "time", "arguments": "{}"}]
    call = lambda id, name, arguments: {"id": id, "type": "function",  # noqa: E731
                                        "function": {"name": name, "arguments": arguments}}
    assert messages("Be brief.", items) == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Paris and Oslo?"},
        {"role": "assistant", "content": "Looking.", "tool_calls": [call("a", "weather", '{"city": "Paris"}'),
                                                                   call("b", "weather", '{"city": "Oslo"}')]},
        {"role": "tool", "tool_call_id": "a", "content": "sunny"},
        {"role": "tool", "tool_call_id": "b", "content": "rain"},
        {"role": "assistant", "content": None, "tool_calls": [call("c", "time", "{}")]}]


def _accumulated(events: list[tuple[str, dict]]) -> list[dict]:
    """The output items a client builds from the events, as the ``openai`` client's stream helper does."""
    items: dict[int, dict] = {}
    for kind, fields in events:
        if kind == "response.output_item.added":
            items[fields["output_index"]] = {**fields["item"], "content": [], "arguments": ""}
        elif kind == "response.content_part.added":
            items[fields["output_index"]]["content"].append(dict(fields["part"]))
        elif kind in ("response.output_text.delta", "response.reasoning_text.delta"):
            items[fields["output_index"]]["content"][fields["content_index"]]["text"] += fields["delta"]
        elif kind == "response.function_call_arguments.delta":
            items[fields["output_index"]]["arguments"] += fields["delta"]
        elif kind == "response.output_item.done":
            item = items[fields["output_index"]]
            assert item["id"] == fields["item"]["id"]
            item["status"] = fields["item"]["status"]
    return [items[i] for i in sorted(items)]


def _plain(item) -> dict:
    """An output item less its generated id, with a call's text fields in one place."""
    out = item.model_dump(exclude_none=True) if hasattr(item, "model_dump") else dict(item)
    out.pop("id")
    out.setdefault("content", [])
    out.setdefault("arguments", "")
    return out


pieces = st.text("ab {}", max_size=4)


@settings(max_examples=200, deadline=None)
@given(st.lists(pieces, max_size=5), st.lists(pieces, max_size=5),
       st.lists(st.tuples(st.sampled_from(["weather", "time"]), st.lists(pieces, min_size=1, max_size=3)),
                max_size=2),
       st.sampled_from(["stop", "length", "tool_calls"]))
def test_streamed_events_build_the_items_of_the_whole_response(thoughts, texts, calls, finish):
    from continuous.serve.calls import Delta
    from continuous.serve.responses import _Output, _status

    status = _status(finish)[0]
    streamed, events = _Output(), []
    for thought in thoughts:
        events += streamed.add(Delta(reasoning=thought))
    for text in texts:
        events += streamed.add(Delta(text=text))
    for index, (name, arguments) in enumerate(calls):  # a call's id and name, then its arguments
        events += streamed.add(Delta(tool_calls=[{"index": index, "id": f"call_{index}", "function": {"name": name}}]))
        for piece in arguments:
            events += streamed.add(Delta(tool_calls=[{"index": index, "function": {"arguments": piece}}]))
    events += streamed.close(status)
    whole = _Output()
    whole.add(Delta(text="".join(texts), reasoning="".join(thoughts), tool_calls=[
        {"id": f"call_{i}", "function": {"name": name, "arguments": "".join(arguments)}}
        for i, (name, arguments) in enumerate(calls)]))
    whole.close(status)
    assert list(map(_plain, _accumulated(events))) == list(map(_plain, streamed.items)) \
        == list(map(_plain, whole.items))
    kinds = [item.type for item in whole.items]
    assert kinds == ["reasoning"] * bool("".join(thoughts)) + ["message"] * bool(
        "".join(texts) or (not calls and status == "completed")) + ["function_call"] * len(calls)
    assert all(item.status == "completed" for item in whole.items[:-1])
    assert not whole.items or whole.items[-1].status == status


def test_log_probabilities_are_the_chat_endpoint_s_whole_and_streamed(client):
    options = dict(model=NAME, input=QUESTION, max_output_tokens=6, temperature=0,
                   include=["message.output_text.logprobs"], top_logprobs=2)
    response = client.responses.create(**options)
    answer = _chat(client, [{"role": "user", "content": QUESTION}], max_tokens=6, temperature=0, logprobs=True,
                   top_logprobs=2)
    (part,) = response.output[0].content
    expected = answer.choices[0].logprobs.content
    assert [(e.token, e.logprob) for e in part.logprobs] == [(e.token, e.logprob) for e in expected]
    assert "".join(e.token for e in part.logprobs) == part.text
    assert all(len(e.top_logprobs) == 2 for e in part.logprobs)
    events = list(client.responses.create(stream=True, **options))
    streamed = [entry for e in events if e.type == "response.output_text.delta" for entry in e.logprobs]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in part.logprobs]
    assert client.responses.create(model=NAME, input=QUESTION, max_output_tokens=2).output[0].content[0].logprobs \
        is None


class City(BaseModel):
    name: str
    country: str
    population_millions: int = Field(ge=0, le=50)


@pytest.mark.real
@pytest.mark.slow
def test_a_trained_model_answers_parses_and_calls_through_responses():
    from support.real import smollm2

    app = build_app(models.transformers(smollm2(), prefix_cache="256MB"), name=NAME)
    with TestClient(app) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0)
        answer = client.responses.create(model=NAME, instructions="Answer in one sentence.", temperature=0,
                                         input="What is the capital of France?", max_output_tokens=40)
        assert answer.status == "completed" and "Paris" in answer.output_text
        city = client.responses.parse(model=NAME, input="Give the name, country and population in millions of "
                                      "Paris as JSON.", text_format=City, max_output_tokens=120, temperature=0)
        assert city.output_parsed.name == "Paris"
        weather = {"type": "function", "name": "get_weather", "description": "The weather in a city", "strict": True,
                   "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                  "required": ["city"], "additionalProperties": False}}
        question = [{"role": "user", "content": "What's the weather like in Paris today?"}]
        first = client.responses.create(model=NAME, input=question, tools=[weather], tool_choice="required",
                                        max_output_tokens=80, temperature=0)
        (call,) = [item for item in first.output if item.type == "function_call"]
        assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
        second = client.responses.create(
            model=NAME, tools=[weather], max_output_tokens=40, temperature=0,
            input=question + [item.model_dump(exclude_none=True) for item in first.output]
            + [{"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "sunny"}'}])
        assert second.status in ("completed", "incomplete") and second.output_text
        assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens // 2
