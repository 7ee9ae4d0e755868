"""A conversation through a model's own chat template, forwarding only the new tokens.

This runs in seconds on a tiny random-weight Qwen2 model with the real Qwen2 tokenizer
and chat template: it shows the mechanics (the text is the template rendered on all
messages, and each turn forwards only its new tokens), and the answers are gibberish
because the weights are random.

Run: ``python examples/chat_template.py``
"""

from continuous import chat, continuous, generate, models
from continuous.testing import build_arch


def main() -> None:
    hf, tokenizer = build_arch("qwen2")
    model = models.transformers(hf, tokenizer)
    gen = continuous(generate.text(model))

    conv = chat.Conversation(model, [{"role": "system", "content": "You answer in one word."}])
    for question in ["What colour is the sky?", "And the sea?", "And grass?"]:
        conv.add("user", question)
        before = model.stats.tokens_forwarded
        answer = conv.reply(gen, max_tokens=6)
        forwarded = model.stats.tokens_forwarded - before
        total = len(tokenizer(str(conv.state), add_special_tokens=False).input_ids)
        print(f"user: {question!r}\nassistant (random weights): {answer!r}")
        print(f"  forwarded {forwarded} tokens this turn; the conversation holds {total}\n")

    rendered = tokenizer.apply_chat_template(conv.messages, tokenize=False)
    print("state text == template on all messages (up to the last end-of-turn):",
          rendered.startswith(str(conv.state)))

    # Without the helper: add one message to a state by hand.
    state = conv.state + chat.turn(model, "user", "Thanks!")
    print(repr(str(state)[-80:]))


if __name__ == "__main__":
    main()
