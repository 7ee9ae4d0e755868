"""Beam search: the most likely whole answers, with their log-probabilities.

Greedy decoding takes the most likely token at each step, which need not give the most
likely sequence; beam search keeps the ``beams`` best sequences so far at every step.
Beams are rows of one state (samples of one prompt), forked from a prefix computed
once, best first. The second prompt shows beam search's known bias: it ranks whole
sequences by the sum of their tokens' log-probabilities, so a short odd answer can
outrank a long plausible one that greedy decoding finds. Run
``python examples/beam_search.py`` or ``--quick`` for one prompt.
"""

import argparse

import torch

from continuous import continuous, generate, models, samplers
from continuous.assets import DEMO_MODEL


def compare(model, generator_for, prompt, beams, **kwargs):
    """Print greedy's answer and the beams, with the weight of each."""
    greedy = continuous(generator_for(samplers.greedy()))(prompt, **kwargs)
    before = model.stats.tokens_forwarded
    state = continuous(generator_for(samplers.beam_search(beams)))(prompt, **kwargs)
    spent = model.stats.tokens_forwarded - before
    print(f"prompt {prompt!r}")
    print(f"  greedy  weight {float(greedy.weights[0, 0]):7.2f} {greedy.value!r}")
    for b, (value, weight) in enumerate(zip(state.value, state.weights[0].tolist())):
        print(f"  beam {b}  weight {weight:7.2f} {value!r}")
    print(f"  {beams} beams forwarded {spent} tokens (the prompt once, {len(model.tokenizer(prompt).input_ids)} tokens)")
    return state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer beams and tokens")
    args = parser.parse_args()
    beams = 2 if args.quick else 4

    model = models.transformers(DEMO_MODEL, dtype=torch.float32)
    prompts = ["User: Tell me about Alice.\nAssistant:", "User: Where is my order #1042?\nAssistant:"]
    for prompt in prompts[:1] if args.quick else prompts:
        compare(model, lambda s: generate.text(model, s), prompt, beams, stop_at="\n",
                max_tokens=20 if args.quick else 32)


if __name__ == "__main__":
    main()
