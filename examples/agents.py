"""Think, then answer; then call a tool and continue after its result.

``think=`` gives any generator a thinking section of free text before its constraint;
with a budget, the library writes the closing marker when the budget is spent.
``generate.tools`` lets the model answer in text or call tools, each call's JSON held
to a tool's schema. The shipped toy model has no thinking markers and was never trained
on tools, so the markers are given (``Think(open=..., close=...)``) and the prompts are
its plain dialogue lines; its choices are arbitrary, but the answers always parse. Run ``python examples/agents.py``
(``--quick`` is the same, it is short).
"""

import argparse

import torch
from pydantic import BaseModel, Field

from continuous import Think, continuous, generate, models
from continuous.assets import DEMO_MODEL


class Order(BaseModel):
    """Order a number of items."""

    item: str = Field(max_length=12)
    count: int = Field(ge=1, le=9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the same, it is short")
    parser.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    model = models.transformers(DEMO_MODEL, dtype=torch.float32)

    # 1. Think (at most 12 tokens), then an integer.
    age = continuous(generate.format(model, int, think=Think("<think>", "</think>", budget=12)))
    stream = age.stream("User: How old is Sven?\nAssistant: ", max_tokens=30)
    kinds = [piece.kind for piece in stream]
    state = stream.state
    print(f"reasoning  : {state.reasoning[0]!r}")
    print(f"value      : {state.value!r}")
    print(f"piece kinds: {' '.join(dict.fromkeys(kinds))}")

    # 2. A call of the Order tool, then the conversation goes on after the tool's result.
    order = continuous(generate.tools(model, [Order], tool_choice="Order"))
    state = order(state + "\nUser: Order me a lamp.\nAssistant: ", max_tokens=60)
    call = state.value.calls[0]
    print(f"call       : {call.name} {call.arguments!r}")
    before = model.stats.tokens_forwarded
    reply = continuous(generate.text(model))(state + "\nTool: ordered.\nAssistant: ", max_tokens=12,
                                               stop_at="\n")
    spent = model.stats.tokens_forwarded - before
    print(f"after the tool: {reply.value!r} (forwarded {spent} tokens for a history of "
          f"{reply.token_ids.shape[1]})")


if __name__ == "__main__":
    main()
