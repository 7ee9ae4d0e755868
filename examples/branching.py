"""Branch a conversation: fork it, sample and rank answers by weight, slice and rewrite.

States are values: a state can be continued any number of times, in any order, and
every branch keeps the cache of the prefix it shares with the others. Run
``python examples/branching.py`` or ``--quick`` for fewer samples and tokens.
"""

import argparse

import torch

from continuous import continuous, generate, models, samplers
from continuous.assets import DEMO_MODEL


def forwarded(model, before: int) -> int:
    return model.stats.tokens_forwarded - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples and tokens")
    args = parser.parse_args()
    n_samples, max_tokens = (2, 24) if args.quick else (4, 40)

    model = models.transformers(DEMO_MODEL, dtype=torch.float32)
    chat = continuous(generate.text(model))

    base = chat("User: Hi, I am Rosa, I am 52 and I live in Cairo.\nAssistant:", stop_at="\n",
                max_tokens=max_tokens)
    print(f"base:\n{str(base).rstrip()}")

    # 1. Two branches of one state. Each forwards only its own new text; the base's
    # cache is shared by both, and neither disturbs the other.
    print("\n1. Two branches from one state")
    for pet, name in [("dog", "Max"), ("turtle", "Kiwi")]:
        before = model.stats.tokens_forwarded
        branch = chat(base + f"User: I have a {pet} called {name}.\nAssistant:", stop_at="\n",
                      max_tokens=max_tokens)
        branch = chat(branch + f"User: What is my {pet}'s name?\nAssistant:", stop_at="\n",
                      max_tokens=max_tokens)
        print(f"  branch {pet}: {branch.value.strip()!r}")
        print(f"    forwarded {forwarded(model, before)} tokens for a history of {int(branch.attention_mask.sum())}; "
              f"the base's {int(base.attention_mask.sum())} were not forwarded again")
    again = chat(base + "User: Where do I live?\nAssistant:", stop_at="\n", max_tokens=max_tokens)
    print(f"  the base, continued after both: {again.value.strip()!r}")

    # 2. Fork samples from one prefix and rank them as whole sequences by their weight,
    # the log-probability of every token generated.
    print(f"\n2. {n_samples} sampled answers, ranked by weight")
    sampler = continuous(generate.text(model, samplers.multinomial(n_samples)))
    question = base + "User: Tell me about Farah.\nAssistant:"
    before = model.stats.tokens_forwarded
    answers = sampler(question, stop_at="\n", max_tokens=max_tokens, seed=1)
    uncached = int(question.attention_mask.sum() - question.cached_lengths.sum())
    print(f"  forwarded {forwarded(model, before)} tokens: the {uncached} uncached tokens of the prefix once, "
          f"then each sample's")
    weights = answers.weights[0].tolist()
    for rank, s in enumerate(sorted(range(n_samples), key=lambda s: -weights[s]), 1):
        print(f"  #{rank} weight {weights[s]:7.2f} {answers.value[s].strip()!r}")
    best = answers[max(range(n_samples), key=lambda s: weights[s]), :]  # one row, cache kept

    # 3. Slice the best answer after "lives in" and write another city: the cache is
    # cropped at the cut, so only the new text and what follows are forwarded.
    print("\n3. Slice an answer and rewrite its end")
    text = str(best)
    if " lives in" in text[len(str(question)):]:
        cut = text.rindex(" lives in") + len(" lives in")
        before = model.stats.tokens_forwarded
        rewritten = chat(best[:cut] + " Oslo", stop_at="\n", max_tokens=max_tokens)
        print(f"  kept {int(best[:cut].cached_lengths[0])} cached tokens of {int(best.attention_mask.sum())}")
        print(f"  {text[len(str(question)):].strip()!r}\n  -> {str(rewritten)[len(str(question)):].strip()!r}")
        print(f"  forwarded {forwarded(model, before)} tokens")
    else:
        print(f"  the best answer has no 'lives in' to cut at: {text[len(str(question)):]!r}")


if __name__ == "__main__":
    main()
