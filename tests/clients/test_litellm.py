"""``litellm`` against the server as an OpenAI-compatible provider: completion, stream,
tools, a pydantic ``response_format`` and ``text_completion``."""

from __future__ import annotations

import json

import litellm
import pytest
from schemas import MAX_TOKENS, MESSAGES, GetWeather, Weather

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def options(base_url, name):
    return {"model": f"openai/{name}", "api_base": base_url, "api_key": "none", "timeout": 120,
            "max_tokens": MAX_TOKENS, "temperature": 0}


def test_completion_and_its_stream_agree(options):
    whole = litellm.completion(messages=MESSAGES, **options)
    streamed = "".join(c.choices[0].delta.content or "" for c in litellm.completion(messages=MESSAGES, stream=True,
                                                                                   **options))
    assert whole.choices[0].message.content == streamed
    assert whole.usage.completion_tokens > 0


def test_tools_give_a_valid_call(options):
    tool = {"type": "function", "function": {"name": "get_weather", "description": GetWeather.__doc__,
                                             "parameters": GetWeather.model_json_schema()}}
    answer = litellm.completion(messages=MESSAGES, tools=[tool],
                                tool_choice={"type": "function", "function": {"name": "get_weather"}}, **options)
    (call,) = answer.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    GetWeather.model_validate(json.loads(call.function.arguments))


def test_pydantic_response_format(options):
    answer = litellm.completion(messages=MESSAGES, response_format=Weather, **options)
    Weather.model_validate_json(answer.choices[0].message.content)


def test_text_completion(options):
    answer = litellm.text_completion(prompt="Once upon a time", **options)
    assert answer.choices[0].text and answer.usage.prompt_tokens > 0
