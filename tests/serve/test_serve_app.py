"""The server through the official ``openai`` client: answers equal the library's, errors are OpenAI's."""

from __future__ import annotations

import http.client
import json
import threading
from typing import Literal
from urllib.parse import urlparse

import openai
import pytest
from pydantic import BaseModel, Field
from support.serving import NAME, TIMEOUT
from support.waiting import wait_until

from continuous import chat, continuous, generate, samplers
from continuous.layout import encode

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # each module starts a server (seconds)

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about Alice."}]


def greedy(local, prompt, n=1, **options):
    """The library's answer to ``prompt`` alone: the reference for the server's."""
    gen = continuous(generate.text(local, samplers.multinomial(n)))
    return gen(prompt, temperature=0, **options)


def test_models_and_health(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == [NAME]
    health = server.health()
    assert health["status"] == "ok" and health["in_flight"] == 0 and "forward_calls" in health["stats"]


def test_chat_answers_as_the_library_does_on_the_chat_template(server, local):
    answer = server.client().chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=12, temperature=0)
    prompt = chat.prompt(local, MESSAGES)
    state = greedy(local, prompt, max_tokens=12)
    (choice,) = answer.choices
    assert choice.message.role == "assistant" and choice.message.content == state.value
    assert choice.finish_reason == {"eos": "stop", "length": "length"}[state.finish_reasons[0]]
    prompt_tokens = len(encode(local.tokenizer, prompt, special=True)[0])
    assert answer.usage.prompt_tokens == prompt_tokens
    assert answer.usage.completion_tokens == state.attention_mask.sum().item() - prompt_tokens
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens
    assert answer.usage.prompt_tokens_details.cached_tokens >= 0


def test_a_chat_re_sending_its_history_is_served_from_the_prefix_cache(server):
    client = server.client()
    messages = [{"role": "system", "content": "You answer about pets, briefly."},
                {"role": "user", "content": "Tell me about Zoë's parrot."}]
    before, last, cached = server.health()["stats"]["tokens_cached"], None, 0
    for turn in range(3):
        answer = client.chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0)
        usage = answer.usage
        saved = usage.prompt_tokens_details.cached_tokens
        assert saved < usage.prompt_tokens  # at least the new message is forwarded
        if last is not None:  # the last turn's prompt, re-sent, is not forwarded again
            assert saved >= last.prompt_tokens
        messages += [{"role": "assistant", "content": answer.choices[0].message.content},
                     {"role": "user", "content": f"And after {turn}?"}]
        last, cached = usage, cached + saved
    assert server.health()["stats"]["tokens_cached"] - before == cached


def test_completions_batch_with_n_and_a_seed_equal_the_library_call(server, local):
    prompts = ["Order #12", "User: Tell me about Bob."]
    answer = server.client().completions.create(model=NAME, prompt=prompts, n=3, max_tokens=8, seed=7)
    gen = continuous(generate.text(local, samplers.multinomial(3)))
    state = gen(prompts, max_tokens=8, seed=7)
    assert [c.index for c in answer.choices] == list(range(6))
    assert [c.text for c in answer.choices] == [t for row in state.value for t in row]
    assert answer.usage.prompt_tokens == sum(len(encode(local.tokenizer, p, special=True)[0]) for p in prompts)


def test_a_stop_string_ends_the_text_and_is_left_out_whole_and_streamed(server, local):
    prompt = "User: Tell me about Eve.\nAssistant:"
    free = greedy(local, prompt, max_tokens=24).value
    stop = free[len(free) // 2:len(free) // 2 + 2]
    client = server.client()
    whole = client.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0, stop=[stop, "\x00"])
    assert whole.choices[0].text == free[:free.index(stop)]
    assert whole.choices[0].finish_reason == "stop"
    pieces = list(client.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0,
                                            stop=[stop, "\x00"], stream=True))
    assert "".join(c.text for p in pieces for c in p.choices) == whole.choices[0].text
    assert [c.finish_reason for p in pieces for c in p.choices if c.finish_reason] == ["stop"]


def test_a_chat_stream_gives_the_whole_answer_its_reason_and_usage(server):
    client = server.client()
    whole = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=16, temperature=0, n=2)
    chunks = list(client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=16, temperature=0, n=2,
                                                 stream=True, stream_options={"include_usage": True}))
    for i in range(2):
        deltas = [c.delta for chunk in chunks for c in chunk.choices if c.index == i]
        assert deltas[0].role == "assistant"
        assert "".join(d.content or "" for d in deltas) == whole.choices[i].message.content
        reasons = [c.finish_reason for chunk in chunks for c in chunk.choices if c.index == i and c.finish_reason]
        assert reasons == [whole.choices[i].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(chunk.usage is None for chunk in chunks[:-1])


class Pet(BaseModel):
    name: str = Field(max_length=8)
    kind: Literal["cat", "dog", "parrot"]
    age: int = Field(ge=0, le=30)
    vaccinated: bool


def test_json_schema_answers_parse_with_pydantic(server):
    client = server.client()
    parsed = client.chat.completions.parse(model=NAME, messages=MESSAGES, response_format=Pet, max_tokens=120,
                                           seed=3)
    assert isinstance(parsed.choices[0].message.parsed, Pet)
    schema = {"name": "pet", "strict": True, "schema": {**Pet.model_json_schema(), "additionalProperties": False}}
    several = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=120, n=3, seed=4,
                                             response_format={"type": "json_schema", "json_schema": schema})
    for choice in several.choices:
        assert choice.finish_reason == "stop", choice.message.content
        Pet.model_validate_json(choice.message.content)
    streamed = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=120, seed=5, stream=True,
                                              response_format={"type": "json_schema", "json_schema": schema})
    Pet.model_validate_json("".join(c.delta.content or "" for chunk in streamed for c in chunk.choices))


def test_json_object_answers_are_objects(server):
    answer = server.client().completions.create(model=NAME, prompt="A record:", max_tokens=200, seed=1,
                                                extra_body={"response_format": {"type": "json_object"}})
    choice = answer.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.text), dict)
    else:  # cut by max_tokens: the beginning of an object
        assert choice.finish_reason == "length" and choice.text.startswith("{")


def test_logprobs_whole_and_streamed(server, local):
    client = server.client()
    whole = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=6, temperature=0,
                                           logprobs=True, top_logprobs=2)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens
    assert "".join(e.token for e in content) == whole.choices[0].message.content
    assert all(len(e.top_logprobs) == 2 and e.bytes == list(e.token.encode()) for e in content)
    streamed = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=6, temperature=0,
                                              logprobs=True, top_logprobs=2, stream=True)
    entries = [e for chunk in streamed for c in chunk.choices if c.logprobs for e in c.logprobs.content]
    assert [(e.token, e.logprob) for e in entries] == [(e.token, e.logprob) for e in content]
    text = client.completions.create(model=NAME, prompt="Order #3", max_tokens=5, temperature=0, logprobs=3)
    logprobs = text.choices[0].logprobs
    state = greedy(local, "Order #3", max_tokens=5, logprobs=3)
    assert logprobs.tokens == [t for t, _, _ in state.logprobs[0]]
    assert logprobs.token_logprobs == pytest.approx([lp for _, lp, _ in state.logprobs[0]], abs=1e-4)
    assert all(len(top) <= 3 for top in logprobs.top_logprobs)
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))]


def test_sixteen_concurrent_clients_each_get_their_own_answer(server, local):
    prompts = [f"User: Tell me about client {i}.\nAssistant:" for i in range(16)]
    answers: dict[int, str] = {}

    def ask(i):
        client = server.client()
        answers[i] = client.completions.create(model=NAME, prompt=prompts[i], max_tokens=16, temperature=0,
                                               ).choices[0].text

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT * 2)
    assert sorted(answers) == list(range(16))
    for i, prompt in enumerate(prompts):
        assert answers[i] == greedy(local, prompt, max_tokens=16).value
    server.wait_idle()


# ------------------------------------------------------------------ bad input
def raw_post(server, path: str, body: bytes) -> tuple[int, dict]:
    where = urlparse(server.url)
    conn = http.client.HTTPConnection(where.hostname, where.port, timeout=TIMEOUT)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        answer = conn.getresponse()
        return answer.status, json.loads(answer.read())
    finally:
        conn.close()


LONG = "Paris Lagos Kyoto " * 2000  # past any test model's context

BAD = {
    "unknown field": ({"messages": MESSAGES, "max_tokens": 4, "temprature": 0.5}, 400, "temprature"),
    "negative max_tokens": ({"messages": MESSAGES, "max_tokens": -1}, 400, "max_tokens"),
    "negative max_completion_tokens": ({"messages": MESSAGES, "max_completion_tokens": -3}, 400,
                                       "max_completion_tokens"),
    "prompt past the context": ({"messages": [{"role": "user", "content": LONG}], "max_tokens": 4}, 400,
                                "messages"),
    "max_tokens past the context": ({"messages": MESSAGES, "max_tokens": 10**6}, 400, "messages"),
    "bad schema": ({"messages": MESSAGES, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objekt"}}}}, 400, "response_format"),
    "unsatisfiable reference": ({"messages": MESSAGES, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"$ref": "#/$defs/nowhere"}}}}, 400, "response_format"),
    "schema missing": ({"messages": MESSAGES, "response_format": {"type": "json_schema"}}, 400, "response_format"),
    "empty messages": ({"messages": []}, 400, "messages"),
    "unknown role": ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
    "temperature out of range": ({"messages": MESSAGES, "temperature": 3}, 400, "temperature"),
    "n zero": ({"messages": MESSAGES, "n": 0}, 400, "n"),
    "top_logprobs without logprobs": ({"messages": MESSAGES, "top_logprobs": 2}, 400, None),
    "empty stop": ({"messages": MESSAGES, "stop": [""]}, 400, "stop"),
    "a penalty out of range": ({"messages": MESSAGES, "frequency_penalty": 2.5}, 400, "frequency_penalty"),
    "tool_choice without tools": ({"messages": MESSAGES, "tool_choice": "auto"}, 400, "tool_choice"),
    "another model": ({"messages": MESSAGES, "model": "gpt-4o"}, 404, "model"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, case):
    body, status, param = BAD[case]
    code, answer = raw_post(server, "/v1/chat/completions", json.dumps({"model": NAME, **body}).encode())
    assert code == status, answer
    error = answer["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    ok = server.client().chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=2)
    assert ok.choices[0].message.content is not None
    assert server.wait_idle()["in_flight"] == 0


@pytest.mark.parametrize("body", [b'{"model": "x", "prompt": "a",', b"\xff\xfe", b"[1, 2]", b""])
def test_malformed_bodies_get_400(server, body):
    code, answer = raw_post(server, "/v1/completions", body)
    assert code == 400 and answer["error"]["type"] == "invalid_request_error", answer


def test_the_openai_client_raises_its_own_errors(server):
    with pytest.raises(openai.BadRequestError) as refused:
        server.client().completions.create(model=NAME, prompt="x", max_tokens=-5)
    assert refused.value.status_code == 400 and refused.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError) as long:
        server.client().completions.create(model=NAME, prompt=LONG, max_tokens=1)
    assert long.value.code == "context_length_exceeded"


# ------------------------------------------------------------------ load: the queue and disconnects
def open_stream(server, max_tokens: int) -> http.client.HTTPConnection:
    """A greedy completion stream, its first event read: the request is running."""
    where = urlparse(server.url)
    conn = http.client.HTTPConnection(where.hostname, where.port, timeout=TIMEOUT)
    body = {"model": NAME, "prompt": "Order #1", "max_tokens": max_tokens, "temperature": 0, "stream": True}
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    answer = conn.getresponse()
    assert answer.status == 200
    assert answer.readline().startswith(b"data: ")
    return conn


def test_a_full_queue_answers_429_and_a_client_gone_mid_stream_frees_its_row(small_server):
    client = small_server.client()
    room = client.models.list().data[0].max_model_len - 16
    full = client.with_options(timeout=TIMEOUT * 4).completions.create(model=NAME, prompt="Order #1",  # a long one
                                                                       max_tokens=room, temperature=0)
    assert full.choices[0].finish_reason == "length"  # left alone, the stream below runs `room` steps
    before = small_server.wait_idle()["stats"]
    conn = open_stream(small_server, room)
    with pytest.raises(openai.RateLimitError) as busy:
        client.completions.create(model=NAME, prompt="hi", max_tokens=2)
    assert busy.value.status_code == 429 and busy.value.body["type"] == "rate_limit_error"
    conn.sock.close()  # the client goes away mid-stream
    conn.close()
    after = small_server.wait_idle()["stats"]
    assert after["forward_calls"] - before["forward_calls"] < room // 2
    again = client.completions.create(model=NAME, prompt="hi", max_tokens=2, temperature=0)
    assert again.choices[0].text is not None
    # Nothing runs on for the stream gone: the model forwarded this request's tokens alone
    # (a stream still decoding would add one token to each of its steps, and more between them).
    spent = small_server.health()["stats"]["tokens_forwarded"] - after["tokens_forwarded"]
    assert spent <= again.usage.prompt_tokens + again.usage.completion_tokens


def test_a_client_gone_before_a_whole_answer_cancels_its_call(small_server):
    client = small_server.client()
    room = client.models.list().data[0].max_model_len - 16
    full = client.with_options(timeout=TIMEOUT * 4).completions.create(model=NAME, prompt="Order #1",  # a long one
                                                                       max_tokens=room, temperature=0)
    assert full.choices[0].finish_reason == "length"  # left alone, the call below runs `room` steps
    before = small_server.wait_idle()["stats"]
    where = urlparse(small_server.url)
    conn = http.client.HTTPConnection(where.hostname, where.port, timeout=TIMEOUT)
    body = {"model": NAME, "prompt": "Order #1", "max_tokens": room, "temperature": 0}
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    # The client gives up once its call is decoding (not after a time guessed from an earlier call's).
    wait_until(lambda: small_server.health()["stats"]["forward_calls"] > before["forward_calls"],
               "the call to start decoding")
    conn.sock.close()
    conn.close()
    after = small_server.wait_idle()["stats"]
    assert after["forward_calls"] - before["forward_calls"] < room * 3 // 4
