"""The server's application in this process, through ``httpx2.ASGITransport`` and the ``openai`` client.

No subprocess and no socket: these run in the fast tier (and so against the newest releases
in ``make test-latest``), on the tiny test model with a small chat template. They cover the
branches of the routes that an answer equal to the library's does not: failures (a 500,
and an error event once a stream has begun), the queue's slots, tools beside a response
format, unknown routes, and the usage chunk of a text stream.
"""

from __future__ import annotations

import asyncio
import json

import httpx2
import openai
import pytest
from support.serving import NAME, TIMEOUT, save_chat_model
from support.waiting import until

from continuous import models
from continuous.serve import build_app
from continuous.serve.calls import Call

MESSAGES = [{"role": "user", "content": "Tell me about Alice."}]
LOOKUP = {"type": "object", "properties": {"name": {"enum": ["Alice", "Bob"]}}, "required": ["name"]}
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Look a name up", "parameters": LOOKUP}}]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return models.transformers(str(save_chat_model(tmp_path_factory.mktemp("inprocess") / "tiny")), dtype="float32")


@pytest.fixture(scope="module")
def app(model):
    return build_app(model, name=NAME, max_queue=8)


@pytest.fixture(scope="module")
def one_slot(model):
    """The same model served one request at a time: a second gets 429."""
    return build_app(model, name=NAME, max_queue=1)


def http(app) -> httpx2.AsyncClient:
    # The app's own exception handler answers a failure with a 500; Starlette then re-raises it
    # for the server's log, which the transport must not turn into the client's exception.
    transport = httpx2.ASGITransport(app, raise_app_exceptions=False)
    return httpx2.AsyncClient(transport=transport, base_url="http://served", timeout=TIMEOUT)


def client(app) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url="http://served/v1", api_key="none", max_retries=0, http_client=http(app))


def run(work):
    return asyncio.run(work)


def events(body: str) -> list:
    """A server-sent event stream's items, ``[DONE]`` as the string."""
    datas = [line.removeprefix("data: ") for line in body.split("\n\n") if line.strip()]
    assert all(line.startswith("data: ") for line in body.split("\n\n") if line.strip()), body
    return [d if d == "[DONE]" else json.loads(d) for d in datas]


async def in_flight(app) -> int:
    async with http(app) as h:
        return (await h.get("/health")).json()["in_flight"]


def assert_openai_error(answer: httpx2.Response, status: int, kind: str) -> dict:
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"] and error["type"] == kind
    return error


# ------------------------------------------------------------------ failures
def test_an_unexpected_failure_is_a_500_in_openais_shape_and_the_server_goes_on(app, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("the template engine broke")

    async def main():
        async with http(app) as h:
            monkeypatch.setattr(app.state.served, "chat_prompt", broken)
            failed = await h.post("/v1/chat/completions", json={"model": NAME, "messages": MESSAGES, "max_tokens": 2})
            error = assert_openai_error(failed, 500, "server_error")
            assert "RuntimeError: the template engine broke" in error["message"]
            with pytest.raises(openai.InternalServerError):
                await client(app).chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=2)
            monkeypatch.undo()
            ok = await client(app).chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=2)
            assert ok.choices[0].finish_reason in ("stop", "length")
        assert await in_flight(app) == 0

    run(main())


def test_a_failure_after_a_stream_began_is_an_error_event_then_done_and_frees_the_slot(one_slot, monkeypatch):
    def broken(self, state):
        raise RuntimeError("the final state could not be read")

    monkeypatch.setattr(Call, "rows", broken)  # read once the last step is done, after the first chunks

    async def main():
        async with http(one_slot) as h:
            answer = await h.post("/v1/chat/completions", json={
                "model": NAME, "messages": MESSAGES, "max_tokens": 4, "temperature": 0, "stream": True})
            assert answer.status_code == 200  # sent before the failure: the error goes in the stream
            items = events(answer.text)
            assert items[0]["choices"][0]["delta"]["role"] == "assistant"
            assert items[-1] == "[DONE]"
            assert items[-2]["error"]["type"] == "server_error"
            assert "RuntimeError: the final state could not be read" in items[-2]["error"]["message"]
            assert all("error" not in item for item in items[:-2])
            with pytest.raises(openai.APIError, match="the final state could not be read"):
                stream = await client(one_slot).chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=4,
                                                                        stream=True)
                async for _ in stream:
                    pass
        assert await in_flight(one_slot) == 0  # the one slot is free again
        monkeypatch.undo()
        ok = await client(one_slot).completions.create(model=NAME, prompt="hi", max_tokens=2)
        assert ok.choices[0].text is not None

    run(main())


# ------------------------------------------------------------------ the queue
def test_a_full_queue_refuses_with_429_and_frees_the_slot_when_the_call_ends(one_slot):
    async def main():
        api = client(one_slot)
        long = asyncio.ensure_future(api.completions.create(model=NAME, prompt="Order #1", max_tokens=64,
                                                            temperature=0))
        await until(lambda: one_slot.state.served.in_flight == 1 or long.done(), "the first request to be admitted")
        assert not long.done()
        with pytest.raises(openai.RateLimitError) as busy:
            await api.completions.create(model=NAME, prompt="hi", max_tokens=2)
        assert busy.value.status_code == 429 and busy.value.body["code"] == "rate_limit_exceeded"
        assert one_slot.state.served.in_flight == 1  # the refusal took no slot, and freed none
        assert (await long).choices[0].finish_reason == "length"
        assert one_slot.state.served.in_flight == 0
        again = await api.completions.create(model=NAME, prompt="hi", max_tokens=2)
        assert again.usage.completion_tokens == 2

    run(main())


def test_a_request_refused_after_admission_frees_its_slot(one_slot, monkeypatch):
    refusals = []

    def refusing(self):
        refusals.append(self)
        raise ValueError("max_tokens must be positive")  # as the library refuses a call's arguments

    async def main():
        async with http(one_slot) as h:
            for _ in range(3):  # with one slot, a slot kept by a refusal would make the next one a 429
                answer = await h.post("/v1/completions", json={"model": NAME, "prompt": "hi", "max_tokens": 2})
                error = assert_openai_error(answer, 400, "invalid_request_error")
                assert error["message"] == "max_tokens must be positive"
            assert len(refusals) == 3 and one_slot.state.served.in_flight == 0
            monkeypatch.undo()
            ok = await h.post("/v1/completions", json={"model": NAME, "prompt": "hi", "max_tokens": 2})
            assert ok.status_code == 200, ok.text

    monkeypatch.setattr(Call, "astream", refusing)
    run(main())


# ------------------------------------------------------------------ tools and formats
def test_tools_with_a_json_response_format_are_refused_and_with_a_text_one_answer(app):
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}

    async def main():
        api = client(app)
        for response_format in (schema, {"type": "json_object"}):
            with pytest.raises(openai.BadRequestError) as refused:
                await api.chat.completions.create(model=NAME, messages=MESSAGES, tools=TOOLS, max_tokens=8,
                                                  response_format=response_format)
            assert refused.value.param == "response_format" and "one constraint" in refused.value.message
        answer = await api.chat.completions.create(model=NAME, messages=MESSAGES, tools=TOOLS, max_tokens=200,
                                                   response_format={"type": "text"}, tool_choice="required",
                                                   temperature=0)
        choice = answer.choices[0]
        # tool_choice "required": the reply is a call of the one tool, with arguments its schema allows
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls
        assert call.function.name == "lookup" and json.loads(call.function.arguments) in ({"name": "Alice"},
                                                                                          {"name": "Bob"})
        assert await in_flight(app) == 0

    run(main())


# ------------------------------------------------------------------ routes
@pytest.mark.parametrize("method, path, status", [
    ("GET", "/v1/nowhere", 404), ("POST", "/v1/embeddings", 404), ("GET", "/", 404),
    ("GET", "/v1/completions", 405)])
def test_unknown_routes_and_methods_get_openai_errors(app, method, path, status):
    async def main():
        async with http(app) as h:
            answer = await h.request(method, path)
        error = assert_openai_error(answer, status, "not_found_error" if status == 404 else "invalid_request_error")
        assert error["param"] is None

    run(main())


def test_an_unknown_route_is_the_openai_clients_not_found_error(app):
    async def main():
        with pytest.raises(openai.NotFoundError) as missing:
            await client(app).embeddings.create(model=NAME, input="hi")
        assert missing.value.status_code == 404 and missing.value.body["type"] == "not_found_error"

    run(main())


# ------------------------------------------------------------------ usage in a text stream
@pytest.mark.parametrize("prompt", ["Order #1", ["Order #1", "Tell me about Bob"]])
def test_a_completions_stream_ends_with_the_usage_of_the_whole_answer_when_asked(app, prompt):
    body = {"model": NAME, "prompt": prompt, "max_tokens": 5, "temperature": 0}

    async def main():
        async with http(app) as h:
            whole = (await h.post("/v1/completions", json=body)).json()
            asked = events((await h.post("/v1/completions", json={
                **body, "stream": True, "stream_options": {"include_usage": True}})).text)
            unasked = events((await h.post("/v1/completions", json={**body, "stream": True})).text)
        return whole, asked, unasked

    whole, asked, unasked = run(main())
    assert asked[-1] == unasked[-1] == "[DONE]"
    usage = asked[-2]
    assert usage["choices"] == [] and usage["usage"]["prompt_tokens"] == whole["usage"]["prompt_tokens"]
    assert usage["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"] > 0
    assert usage["usage"]["total_tokens"] == whole["usage"]["total_tokens"]
    assert all("usage" not in item for item in asked[:-2]) and all("usage" not in item for item in unasked[:-1])
    texts = ["".join(c["text"] for item in asked[:-2] for c in item["choices"] if c["index"] == i)
             for i in range(len(whole["choices"]))]
    assert texts == [c["text"] for c in whole["choices"]]
