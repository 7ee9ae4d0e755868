"""``instructor`` against the server: its JSON-schema and tools modes give valid objects."""

from __future__ import annotations

import instructor
import openai
import pytest
from schemas import MAX_TOKENS, MESSAGES, GetWeather, Weather

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def client(base_url):
    return openai.OpenAI(base_url=base_url, api_key="none", timeout=120, max_retries=0)


@pytest.mark.parametrize("mode", [instructor.Mode.JSON_SCHEMA, instructor.Mode.TOOLS])
def test_instructor_modes_give_the_response_model(client, name, mode):
    patched = instructor.from_openai(client, mode=mode)
    for seed in (0, 1):
        answer = patched.chat.completions.create(model=name, response_model=Weather, messages=MESSAGES,
                                                 max_tokens=MAX_TOKENS, seed=seed, max_retries=0)
        assert isinstance(answer, Weather)


def test_instructor_partial_streams_growing_objects(client, name):
    patched = instructor.from_openai(client, mode=instructor.Mode.JSON_SCHEMA)
    parts = list(patched.chat.completions.create_partial(model=name, response_model=GetWeather,
                                                         messages=MESSAGES, max_tokens=MAX_TOKENS, max_retries=0))
    assert len(parts) > 1  # streamed, not one answer at the end
    final = GetWeather.model_validate(parts[-1].model_dump())
    assert final.city in ("Paris", "Rome", "Oslo")
