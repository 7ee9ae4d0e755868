"""What the client tests ask for: schemas whose every value is bounded, so that even a
random model ends each answer within the token limit."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

MAX_TOKENS = 120


class Weather(BaseModel):
    """A weather report."""

    city: Literal["Paris", "Rome", "Oslo"]
    sky: Literal["sun", "rain", "snow"]
    windy: bool


class GetWeather(BaseModel):
    """Get the weather in a city."""

    city: Literal["Paris", "Rome", "Oslo"]
    unit: Literal["celsius", "fahrenheit"] = Field(description="the unit of the temperature")


MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
