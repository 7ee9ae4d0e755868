"""OpenAI's sampling controls: ``logit_bias``, ``presence_penalty`` and ``frequency_penalty``."""

from __future__ import annotations

import openai
import pytest
from support.serving import NAME, in_process

from continuous import chat, continuous, generate
from continuous.serve import build_app

MESSAGES = [{"role": "user", "content": "Tell me about Alice."}]
PROMPT = "User: Tell me about Alice.\nAssistant:"


@pytest.fixture(scope="module")
def client(chat_model):
    with in_process(build_app(chat_model, name=NAME)) as client:
        yield client


def test_the_controls_give_the_library_s_answer_and_change_it(client, chat_model):
    gen = continuous(generate.text(chat_model))
    plain = gen(PROMPT, max_tokens=20, temperature=0)
    options = {"presence_penalty": 1.2, "frequency_penalty": 0.7, "logit_bias": {42: 5.0, 7: -100.0}}
    state = gen(PROMPT, max_tokens=20, temperature=0, **options)
    assert state.value != plain.value
    wire = {**options, "logit_bias": {str(k): v for k, v in options["logit_bias"].items()}}
    answer = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=20, temperature=0, **wire)
    assert answer.choices[0].text == state.value
    chatted = gen(chat.prompt(chat_model, MESSAGES), max_tokens=20, temperature=0, **options)
    answer = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=20, temperature=0, **wire)
    assert answer.choices[0].message.content == chatted.value


def test_a_token_biased_by_100_is_all_the_answer(client, chat_model):
    token = 42
    answer = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=6, temperature=1, seed=0,
                                       logit_bias={str(token): 100})
    assert answer.choices[0].text == chat_model.tokenizer.decode([token] * 6)


@pytest.mark.parametrize("options, param", [
    ({"logit_bias": {"1000000": 1}}, "logit_bias"),
    ({"logit_bias": {"a": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"presence_penalty": -2.5}, "presence_penalty"),
    ({"frequency_penalty": 2.01}, "frequency_penalty"),
])
def test_controls_out_of_range_are_refused(client, options, param):
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=NAME, prompt=PROMPT, max_tokens=2, **options)
    assert refused.value.param == param and refused.value.code == "invalid_value", refused.value.message
