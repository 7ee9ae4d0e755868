"""``langchain-openai`` against the server: structured output in each method, tools over
two turns with a ToolMessage, and streams that report their usage."""

from __future__ import annotations

import pytest
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_openai import ChatOpenAI
from schemas import MAX_TOKENS, GetWeather, Weather

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def chat(base_url, name):
    return ChatOpenAI(base_url=base_url, api_key="none", model=name, max_tokens=MAX_TOKENS, temperature=0,
                      timeout=120, max_retries=0)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output_gives_the_model(chat, method):
    answer = chat.with_structured_output(Weather, method=method).invoke("What is the weather in Paris?")
    assert isinstance(answer, Weather)


def test_bind_tools_over_two_turns_with_a_tool_message(chat):
    tools = chat.bind_tools([GetWeather], tool_choice="GetWeather")
    question = HumanMessage("What is the weather in Paris?")
    called = tools.invoke([question])
    (call,) = called.tool_calls
    assert call["name"] == "GetWeather" and GetWeather.model_validate(call["args"])
    # The loop sends its own call back with the tool's answer; the model answers in text.
    answer = chat.bind_tools([GetWeather]).invoke(
        [question, called, ToolMessage(content="18 degrees, sunny", tool_call_id=call["id"])],
        tool_choice="none")
    assert isinstance(answer.content, str) and not answer.tool_calls


def test_stream_reports_usage(base_url, name):
    chat = ChatOpenAI(base_url=base_url, api_key="none", model=name, max_tokens=8, temperature=0,
                      stream_usage=True, timeout=120, max_retries=0)
    chunks = list(chat.stream("Say something."))
    total = chunks[0]
    for chunk in chunks[1:]:
        total = total + chunk
    assert total.usage_metadata["output_tokens"] == 8 or total.response_metadata.get("finish_reason") == "stop"
    assert total.usage_metadata["input_tokens"] > 0
    assert total.content == chat.invoke("Say something.").content
