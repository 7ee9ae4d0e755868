"""``/tokenize`` and ``/detokenize``: the tokens a request counts, and back to its text."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.serving import NAME, in_process

from continuous import chat
from continuous.layout import encode
from continuous.serve import build_app

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about Alice."}]


@pytest.fixture(scope="module")
def app(chat_model):
    return build_app(chat_model, name=NAME)


@pytest.fixture(scope="module")
def http(app):
    with TestClient(app) as client:
        yield client


def test_a_prompt_s_tokens_are_those_its_completion_counts(app, http, chat_model):
    prompt = "User: Tell me about Bob.\nAssistant:"
    with in_process(app) as client:
        usage = client.completions.create(model=NAME, prompt=prompt, max_tokens=1).usage
    answer = http.post("/tokenize", json={"model": NAME, "prompt": prompt}).json()
    assert answer["tokens"] == encode(chat_model.tokenizer, prompt, special=True)[0]
    assert answer["count"] == len(answer["tokens"]) == usage.prompt_tokens
    assert answer["max_model_len"] == chat_model.max_length and answer.get("token_strs") is None
    bare = http.post("/tokenize", json={"prompt": prompt, "add_special_tokens": False}).json()
    assert bare["tokens"] == encode(chat_model.tokenizer, prompt, special=False)[0]


def test_messages_tokens_are_those_of_their_chat_prompt_as_a_chat_request_counts_them(app, http, chat_model):
    with in_process(app) as client:
        usage = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=1).usage
    answer = http.post("/tokenize", json={"model": NAME, "messages": MESSAGES, "return_token_strs": True}).json()
    assert answer["count"] == usage.prompt_tokens
    assert answer["tokens"] == encode(chat_model.tokenizer, chat.prompt(chat_model, MESSAGES), special=True)[0]
    assert answer["token_strs"] == chat_model.tokenizer.convert_ids_to_tokens(answer["tokens"])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40))
def test_detokenize_gives_back_the_text_of_tokenize(http, text):
    tokens = http.post("/tokenize", json={"content": text, "add_special_tokens": False}).json()["tokens"]
    answer = http.post("/detokenize", json={"model": NAME, "tokens": tokens}).json()
    assert answer["prompt"] == answer["content"] == text


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"prompt": "a", "messages": MESSAGES}, 400, "messages"),
    ("/tokenize", {"model": NAME}, 400, "prompt"),
    ("/tokenize", {"model": "other", "prompt": "a"}, 404, "model"),
    ("/detokenize", {"tokens": [1, -1]}, 400, "tokens"),
    ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
    ("/detokenize", {"tokens": ["1"]}, 400, "tokens.0"),
])
def test_bad_requests_are_refused_with_their_param(http, path, body, status, param):
    answer = http.post(path, json=body)
    assert answer.status_code == status and answer.json()["error"]["param"] == param, answer.text
