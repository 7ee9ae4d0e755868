"""A JSON record shown while it is written: each step yields the value parsed so far.

``gen.stream(prompt, partial=True)`` yields, per step, a partial pydantic object (built
with ``model_construct``: the fields written so far, a string by its prefix, nothing
validated), and as its last item the complete, validated ``value``. A user interface can
show a record filling in, field by field, with no JSON parser of its own.

Run ``python examples/streaming_values.py`` (``--quick`` for one record).
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one record only")
    args = parser.parse_args()

    model = models.transformers(DEMO_MODEL, dtype=torch.float32)
    gen = continuous(generate.json(model, Person))
    prompts = ["Describe a person as JSON:\n", "User: Describe a person as JSON.\nAssistant:"]
    for prompt in prompts[:1] if args.quick else prompts:
        shown = None
        stream = gen.stream(prompt, partial=True, max_tokens=80)
        for value in stream:
            if value != shown:  # a step that changed nothing (layout, a key not yet closed) is not shown
                fields = sorted(value.model_fields_set) if value is not None else []
                print(f"  {value!r}  fields so far: {fields}")
                shown = value
        # The last item is the complete value, validated: the state's value.
        print(f"complete: {type(value).__name__} {value.model_dump_json()}; "
              f"the state's value: {value == stream.state.value}")
        print(f"text: {str(stream.state)[len(prompt):]!r}")


if __name__ == "__main__":
    main()
