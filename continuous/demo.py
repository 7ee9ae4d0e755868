"""``make demo``: the whole idea on a small model built on the fly (random weights).

Run with ``python -m continuous.demo``. The model babbles (its weights are random),
but every figure printed is real: what is generated satisfies its constraint, and the
token counts show what the KV cache saved.
"""

from __future__ import annotations

import sys
import time

from pydantic import BaseModel, Field


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)


def main() -> int:
    from continuous import continuous, generate, models, samplers
    from continuous.testing import build_llama, build_tokenizer

    t0 = time.perf_counter()
    print("Building a small Llama model (random weights) and its BPE tokenizer...", flush=True)
    tokenizer = build_tokenizer(2000)
    model = models.transformers(build_llama(tokenizer, "small", max_position_embeddings=2048), tokenizer)
    print(f"  ready in {time.perf_counter() - t0:.1f}s\n")

    gen_json = continuous(generate.json(model, Person, whitespace_pattern=""))
    state = gen_json("Describe a person as JSON:\n", max_tokens=60)
    print("1. JSON under a pydantic schema")
    print(f"   text : {str(state)!r}")
    try:
        print(f"   value: {state.value!r}")
    except ValueError as exc:
        print(f"   value: (did not finish within max_tokens: {exc.__class__.__name__})")

    print("\n2. A conversation: each turn forwards only its new tokens")
    chat = continuous(generate.text(model))
    history = "System: you answer briefly.\n"
    state = chat(history + "User: hello\nAssistant:", max_tokens=12)
    recompute = model.stats.tokens_forwarded
    for turn in ["Where is Lima?", "And Oslo?", "Thanks!"]:
        before = model.stats.tokens_forwarded
        state = chat(state + f"\nUser: {turn}\nAssistant:", max_tokens=12)
        spent = model.stats.tokens_forwarded - before
        # Recomputing the whole history each turn would forward every token again.
        full = int(state.attention_mask.sum())
        recompute += full
        print(f"   turn {turn!r:18} forwarded {spent:3d} tokens (recomputing the history: {full})")

    print("\n3. Slice an answer and continue from the slice: the cache is cropped, not recomputed")
    head = state[: len(str(state)) - 20]
    before = model.stats.tokens_forwarded
    chat(head, max_tokens=5)
    print(f"   kept {int(head.cached_lengths[0])} cached tokens; continuing forwarded "
          f"{model.stats.tokens_forwarded - before}")

    print("\n4. Fork 4 samples from one prefix: the prefix is computed once")
    before = model.stats.tokens_forwarded
    forks = continuous(generate.choice(model, ["yes", "no", "maybe"], samplers.multinomial(4)))(
        state + "\nUser: ok?\nAssistant:", seed=0)
    print(f"   values {forks.value}, forwarded {model.stats.tokens_forwarded - before} tokens")

    print("\n5. Beam search keeps 3 beams with their log-probabilities")
    beams = continuous(generate.format(model, int, samplers.beam_search(3)))("The answer is ", max_tokens=4)
    for text, weight in zip(beams.value, beams.weights[0].tolist()):
        print(f"   {text!r:10} weight {weight:.2f}")
    print(f"\nDone in {time.perf_counter() - t0:.1f}s; model.stats = {model.stats}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
