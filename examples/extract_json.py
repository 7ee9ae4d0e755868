"""Extract typed records from sentences, with every value grounded in its sentence.

The JSON is constrained to a schema while it is generated, so every output parses. A
model as small as the demo's does not copy words from a sentence into JSON reliably
(it writes a plausible record of its own), so the schema is built per sentence: each
string field must be one of the sentence's words and each number one of its numbers
(JSON-schema ``enum``s). The model then only chooses which word fills which field,
which it does well, and the result is validated into a pydantic object. Run
``python examples/extract_json.py`` or ``--quick`` for two sentences.
"""

import argparse
import re
from typing import Literal

import torch
from pydantic import BaseModel, Field

from continuous import continuous, generate, models
from continuous.assets import DEMO_MODEL


class Person(BaseModel):
    name: str
    age: int
    city: str
    pet: str


class Order(BaseModel):
    id: int = Field(ge=1000, le=9999)
    item: str
    quantity: int = Field(ge=1, le=99)
    city: str
    status: Literal["pending", "shipped", "delivered"]


def grounded_schema(record: type[BaseModel], sentence: str) -> dict:
    """``record``'s JSON schema with each str and int field limited to the sentence's words and numbers.

    A number outside a field's bounds is not offered to it, so bounds still tell an
    order's id from its quantity.
    """
    words = sorted(set(re.findall(r"[^\W\d_]+", sentence)))
    numbers = sorted({int(n) for n in re.findall(r"\d+", sentence)})
    schema = record.model_json_schema()
    for field in schema["properties"].values():
        if field.get("type") == "string":
            field.pop("type")
            field["enum"] = words
        elif field.get("type") == "integer":
            field.pop("type")
            low, high = field.pop("minimum", -float("inf")), field.pop("maximum", float("inf"))
            field["enum"] = [n for n in numbers if low <= n <= high]
    return schema


def extract(model, record: type[BaseModel], sentence: str) -> BaseModel:
    gen = continuous(generate.json(model, grounded_schema(record, sentence)))
    state = gen(f"Text: {sentence}\nJSON:\n", max_tokens=60)
    return record.model_validate(state.value)  # a dict schema gives a dict: make it typed


PEOPLE = [
    "Sven is 41 years old, lives in Porto and has a parrot.",
    "Mei lives in Nairobi with a rabbit. She is 27.",
    "Meet Tariq: 63 years old, from Seoul, owner of a horse.",
    "In Kyoto lives Rosa, who is 52 and has a cat.",
]
ORDERS = [
    "Order #4821: 2 x guitar to Dakar, shipped.",
    "Order #7310 for 5 x kettle is pending (delivery to Madrid).",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two sentences only")
    args = parser.parse_args()

    model = models.transformers(DEMO_MODEL, dtype=torch.float32)
    jobs = [(Person, s) for s in PEOPLE] + [(Order, s) for s in ORDERS]
    for record, sentence in jobs[:2] if args.quick else jobs:
        value = extract(model, record, sentence)
        print(f"{sentence}\n  -> {type(value).__name__} {value.model_dump_json()}")


if __name__ == "__main__":
    main()
