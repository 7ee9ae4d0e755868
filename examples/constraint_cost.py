"""What a constraint cost: the probability mass it took from the model, in nats.

``state.constraint_cost[row]`` sums, over a call's steps, ``-log`` of the probability
that the model gave to the tokens the constraint allowed. A schema that says what the
model would write anyway costs about nothing; one that pushes the model off its answer
costs more: the number says how much the output is the schema's rather than the model's.
Run ``python examples/constraint_cost.py`` (``--quick`` is the same: it is short).
"""

import argparse

import torch
from pydantic import BaseModel

from continuous import continuous, generate, models
from continuous.assets import DEMO_MODEL


class Person(BaseModel):
    name: str
    age: int
    city: str
    pet: str


def pushed(record: type[BaseModel]) -> dict:
    """``record``'s schema with the pet one the model never saw and an age it rarely writes."""
    schema = record.model_json_schema()
    schema["properties"]["pet"] = {"enum": ["dragon", "unicorn"]}
    schema["properties"]["age"] = {"type": "integer", "minimum": 90, "maximum": 99}
    return schema


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the same run (it is short)")
    parser.parse_args()
    model = models.transformers(DEMO_MODEL, dtype=torch.float32)
    prompt = "Describe a person as JSON:\n"
    free = continuous(generate.text(model))(prompt, max_tokens=30)
    print(f"free text             : cost {free.constraint_cost[0]:.3f} nats")
    for name, schema in (("the model's own", Person), ("pushed off it", pushed(Person))):
        state = continuous(generate.json(model, schema))(prompt, max_tokens=60)
        print(f"schema, {name:15}: cost {state.constraint_cost[0]:.3f} nats -> {dict(state.value)}")


if __name__ == "__main__":
    main()
