"""Refused requests: every 400 is OpenAI's error and names the field (``param``) and the kind (``code``)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from support.serving import NAME

from continuous.serve import build_app

MESSAGES = [{"role": "user", "content": "Hi"}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}

#: name -> (endpoint, body, param, code)
BAD = {
    "seed past 64 bits": ("chat", {"messages": MESSAGES, "seed": 2**64}, "seed", "invalid_value"),
    "seed below 64 bits": ("text", {"prompt": "a", "seed": -(2**63) - 1}, "seed", "invalid_value"),
    "max_tokens as a string": ("chat", {"messages": MESSAGES, "max_tokens": "5"}, "max_tokens", "invalid_type"),
    "max_tokens as a float": ("text", {"prompt": "a", "max_tokens": 5.0}, "max_tokens", "invalid_type"),
    "n as a string": ("text", {"prompt": "a", "n": "2"}, "n", "invalid_type"),
    "stream as a string": ("chat", {"messages": MESSAGES, "stream": "true"}, "stream", "invalid_type"),
    "stream_options without stream": ("chat", {"messages": MESSAGES, "stream_options": {"include_usage": True}},
                                      "stream_options", "invalid_value"),
    "stream_options with stream false": ("text", {"prompt": "a", "stream": False,
                                                  "stream_options": {"include_usage": True}},
                                         "stream_options", "invalid_value"),
    "a tool message answering no call": ("chat", {"messages": [*MESSAGES, {"role": "tool", "content": "4",
                                                                           "tool_call_id": "call_9"}]},
                                         "messages.1.tool_call_id", "invalid_value"),
    "a tool message answering a later call": ("chat", {"messages": [
        *MESSAGES, {"role": "tool", "content": "4", "tool_call_id": "call_1"},
        {"role": "assistant", "tool_calls": [CALL]}]}, "messages.1.tool_call_id", "invalid_value"),
    "a tool message without its id": ("chat", {"messages": [
        *MESSAGES, {"role": "assistant", "tool_calls": [CALL]}, {"role": "tool", "content": "4"}]},
        "messages.2.tool_call_id", "invalid_value"),
    "both limits": ("chat", {"messages": MESSAGES, "max_tokens": 2, "max_completion_tokens": 2},
                    "max_completion_tokens", "invalid_value"),
    "top_logprobs without logprobs": ("chat", {"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs",
                                      "invalid_value"),
    "best_of other than n": ("text", {"prompt": "a", "best_of": 3}, "best_of", "invalid_value"),
    "schema without json_schema": ("chat", {"messages": MESSAGES, "response_format": {"type": "json_schema"}},
                                   "response_format", "invalid_value"),
    "an unknown field": ("chat", {"messages": MESSAGES, "temprature": 1}, "temprature", "unknown_parameter"),
    "no messages field": ("chat", {}, "messages", "missing_required_parameter"),
    "an unknown role": ("chat", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role",
                        "invalid_value"),
    "tool_choice without tools": ("chat", {"messages": MESSAGES, "tool_choice": "auto"}, "tool_choice",
                                  "invalid_value"),
    "prompt past the context": ("text", {"prompt": "word " * 2000}, "prompt", "context_length_exceeded"),
}
PATHS = {"chat": "/v1/chat/completions", "text": "/v1/completions"}


@pytest.fixture(scope="module")
def http(chat_model):
    with TestClient(build_app(chat_model, name=NAME)) as client:
        yield client


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_refusal_names_its_param_and_code(http, case):
    endpoint, body, param, code = BAD[case]
    answer = http.post(PATHS[endpoint], json={"model": NAME, **body})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert (error["param"], error["code"], error["type"]) == (param, code, "invalid_request_error"), error
    assert error["message"]


def test_a_tool_message_answering_an_earlier_call_is_served(http):
    messages = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "content": "4", "tool_call_id": "call_1"}]
    answer = http.post(PATHS["chat"], json={"model": NAME, "messages": messages, "max_tokens": 2})
    assert answer.status_code == 200, answer.text


@pytest.mark.parametrize("seed", [-(2**63), 0, 2**64 - 1])
def test_every_seed_torch_takes_is_served(http, seed):
    answer = http.post(PATHS["text"], json={"model": NAME, "prompt": "a", "max_tokens": 2, "seed": seed})
    assert answer.status_code == 200, answer.text


@pytest.mark.parametrize("body", [b"[1, 2]", b'"text"', b""])
def test_a_body_that_is_not_an_object_is_refused_as_a_whole(http, body):
    answer = http.post(PATHS["text"], content=body, headers={"Content-Type": "application/json"})
    assert answer.status_code == 400
    assert answer.json()["error"]["code"] in ("invalid_body", "invalid_json")


@pytest.mark.parametrize("method, path, status, code", [("get", "/v1/nowhere", 404, "not_found"),
                                                        ("get", "/v1/completions", 405, "method_not_allowed"),
                                                        ("post", "/v1/completions", 404, "model_not_found")])
def test_other_refusals_have_a_code_too(http, method, path, status, code):
    answer = getattr(http, method)(path, **({"json": {"model": "other", "prompt": "a"}} if method == "post" else {}))
    assert answer.status_code == status and answer.json()["error"]["code"] == code, answer.text
