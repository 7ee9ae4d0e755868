"""A conversation through a chat template, forwarding only the new tokens.

The demo model shipped with the package was trained on ``User: ...`` /
``Assistant: ...`` dialogues; its chat template (``chat_template.jinja`` beside its
weights) renders messages in that format, as a real model's tokenizer renders its own.
Each turn forwards only its new tokens, and the state's text is always the template
rendered on all messages.

Run: ``python examples/chat_template.py``
"""

import torch

from continuous import chat, continuous, generate, models
from continuous.assets import DEMO_MODEL

def main() -> None:
    model = models.transformers(DEMO_MODEL, dtype=torch.float32)
    gen = continuous(generate.text(model))

    conv = chat.Conversation(model)
    for question in ["Tell me about Omar.", "And about Lena?", "Where does Bob live?"]:
        conv.add("user", question)
        before = model.stats.tokens_forwarded
        answer = conv.reply(gen, max_tokens=40, stop_at="\n")  # the toy's answer is one line
        forwarded = model.stats.tokens_forwarded - before
        total = len(model.tokenizer(str(conv.state)).input_ids)
        print(f"user: {question!r}\nassistant: {answer!r}")
        print(f"  forwarded {forwarded} tokens this turn; the conversation holds {total}\n")

    rendered = chat.prompt(model, conv.messages, add_generation_prompt=False)
    print("state text == template on all messages:", rendered.startswith(str(conv.state)))

    # Without the Conversation: add one message to a state by hand.
    state = conv.state + chat.turn(model, "user", "Thanks!")
    print(repr(str(state)[-60:]))


if __name__ == "__main__":
    main()
