"""Our constraints as request parameters: ``structured_outputs`` and vLLM's older ``guided_*``."""

from __future__ import annotations

import json
import re

import openai
import pytest
from support.serving import NAME, in_process

from continuous import chat, continuous, generate, samplers
from continuous.serve import build_app

MESSAGES = [{"role": "user", "content": "Is the sky blue?"}]
PROMPT = "User: Is the sky blue?\nAssistant:"
REGEX = r"(yes|no), [a-z]{2,6}\."
CHOICES = ["yes", "no", "maybe not"]
GRAMMAR = 'start: ANSWER " because " NUMBER\nANSWER: "yes" | "no"\nNUMBER: /[0-9]{1,3}/'
SCHEMA = {"type": "object", "properties": {"answer": {"type": "boolean"}, "score": {"type": "integer"}},
          "required": ["answer", "score"], "additionalProperties": False}


@pytest.fixture(scope="module")
def client(chat_model):
    with in_process(build_app(chat_model, name=NAME)) as client:
        yield client


def library(model, made, prompt, **options):
    """The library's greedy answer: the reference for the server's."""
    return continuous(made)(prompt, temperature=0, max_tokens=40, **options)


def after(state, prompt: str) -> str:
    """The generated text of a one-row state."""
    return str(state)[len(prompt):]


@pytest.mark.parametrize("kind, spec, build", [
    ("regex", REGEX, lambda m: generate.regex(m, REGEX)),
    ("grammar", GRAMMAR, lambda m: generate.cfg(m, GRAMMAR)),
    ("json", SCHEMA, lambda m: generate.json(m, SCHEMA)),
    ("json", json.dumps(SCHEMA), lambda m: generate.json(m, SCHEMA)),
])
def test_each_constraint_answers_as_the_library_on_both_endpoints(client, chat_model, kind, spec, build):
    text = after(library(chat_model, build(chat_model), PROMPT), PROMPT)
    for extra in ({"structured_outputs": {kind: spec}}, {f"guided_{kind}": spec}):
        answer = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=40, temperature=0, extra_body=extra)
        assert answer.choices[0].text == text
    prompt = chat.prompt(chat_model, MESSAGES)
    chatted = after(library(chat_model, build(chat_model), prompt), prompt)
    answer = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=40, temperature=0,
                                            extra_body={"structured_outputs": {kind: spec}})
    content = answer.choices[0].message.content
    assert content == chatted
    if kind == "regex" and answer.choices[0].finish_reason == "stop":
        assert re.fullmatch(REGEX, content)


def test_a_choice_gives_one_option_and_every_option_s_score(client, chat_model):
    state = library(chat_model, generate.choice(chat_model, CHOICES, scores=True), PROMPT)
    answer = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=10, temperature=0,
                                       extra_body={"guided_choice": CHOICES})
    (choice,) = answer.choices
    assert choice.text == state.value and choice.finish_reason == "stop"
    assert choice.choice_scores == pytest.approx(state.choice_scores[0], abs=1e-4)
    assert set(choice.choice_scores) == set(CHOICES) and all(s < 0 for s in choice.choice_scores.values())
    chunks = list(client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=10, n=2, seed=1,
                                                 stream=True, extra_body={"structured_outputs": {"choice": CHOICES}}))
    for i in range(2):
        text = "".join(c.delta.content or "" for chunk in chunks for c in chunk.choices if c.index == i)
        scored = [c.choice_scores for chunk in chunks for c in chunk.choices
                  if c.index == i and getattr(c, "choice_scores", None)]
        assert text in CHOICES and len(scored) == 1 and set(scored[0]) == set(CHOICES)


@pytest.mark.parametrize("extra, param, code", [
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "invalid_value"),
    ({"structured_outputs": {}}, "structured_outputs", "invalid_value"),
    ({"structured_outputs": {"regex": "a"}, "guided_choice": ["b"]}, "guided_choice", "invalid_value"),
    ({"guided_json": SCHEMA, "response_format": {"type": "json_object"}}, "guided_json", "invalid_value"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "invalid_value"),
    ({"structured_outputs": {"whitespace": "a"}}, "structured_outputs.whitespace", "unknown_parameter"),
    ({"guided_json": "{not json"}, "guided_json", "invalid_value"),
    ({"guided_json": "[1]"}, "guided_json", "invalid_value"),
    ({"guided_regex": "(unclosed"}, "guided_regex", "invalid_regex"),
    ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs.grammar", "invalid_grammar"),
    ({"structured_outputs": {"json": {"type": "objekt"}}}, "structured_outputs.json", "invalid_json_schema"),
])
def test_a_wrong_constraint_is_refused_naming_its_field(client, extra, param, code):
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=NAME, prompt=PROMPT, max_tokens=4, extra_body=extra)
    assert (refused.value.param, refused.value.code) == (param, code), refused.value.message


def test_tools_and_a_constraint_are_refused_together(client):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=NAME, messages=MESSAGES, tools=tools, max_tokens=4,
                                       extra_body={"guided_regex": "a"})
    assert refused.value.param == "guided_regex"
