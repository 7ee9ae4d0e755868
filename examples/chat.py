"""A multi-turn chat whose history is never recomputed.

Each turn adds the user's message to the state of the previous turn and generates the
answer: only the new message and the answer go through the model, however long the
conversation grows. Run ``python examples/chat.py`` (a scripted conversation),
``--interactive`` to type the user's lines yourself, or ``--quick`` for three turns.
"""

import argparse

import torch

from continuous import continuous, generate, models
from continuous.assets import DEMO_MODEL

SCRIPT = [
    "Hi, I am Priya, I am 29 and I live in Oslo.",
    "I have a cat called Luna.",
    "Where do I live?",
    "What is Oslo known for?",
    "What is my cat's name?",
    "How old am I?",
    "Thanks!",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="three turns only")
    parser.add_argument("--interactive", action="store_true", help="type the user's lines (empty line ends)")
    args = parser.parse_args()

    model = models.transformers(DEMO_MODEL, dtype=torch.float32)
    chat = continuous(generate.text(model))
    lines = iter(lambda: input("User: "), "") if args.interactive else iter(SCRIPT[:3] if args.quick else SCRIPT)

    state = None
    for turn, user in enumerate(lines, 1):
        if not args.interactive:
            print(f"User: {user}")
        message = f"User: {user}\nAssistant:"
        before = model.stats.tokens_forwarded
        # stop_at ends the answer at its newline; the state keeps it, value does not.
        state = chat(message if state is None else state + message, stop_at="\n", max_tokens=48)
        forwarded = model.stats.tokens_forwarded - before
        history = int(state.attention_mask.sum())
        print(f"Assistant:{state.value}")
        print(f"  [turn {turn}: forwarded {forwarded} tokens; history {history} tokens]")
    if state is not None:
        print(f"total forwarded {model.stats.tokens_forwarded} tokens for a history of "
              f"{int(state.attention_mask.sum())} tokens")


if __name__ == "__main__":
    main()
