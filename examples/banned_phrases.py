"""Banned phrases: the model may not say them, and nothing it already said is recomputed.

The shipped model answers "Tell me about Omar." with phrases it likes. With ``ban=`` a
row that starts a banned phrase rewinds to the token where the phrase starts, forbids
that token there, and goes on: the kept text is never forwarded again, and a stream
never shows text that is later taken back. Run ``python examples/banned_phrases.py``
(``--quick`` for a shorter answer).
"""

import argparse

import torch

from continuous import continuous, generate, models
from continuous.assets import DEMO_MODEL


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a shorter answer")
    args = parser.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    model = models.transformers(DEMO_MODEL, dtype=torch.float32)
    prompt = "User: Tell me about Omar.\nAssistant:"
    n = 24 if args.quick else 48

    free = continuous(generate.text(model))(prompt, max_tokens=n, stop_at="\n")
    words = [w.strip(".,") for w in free.value.split()]
    banned = [w for w in words if len(w) > 3][:2]  # words the model chose: it must now avoid them
    print(f"free answer   : {free.value!r}")
    print(f"banned        : {banned}")

    gen = continuous(generate.text(model, ban=banned))
    before = model.stats.snapshot()
    streamed = "".join(gen.stream(prompt, max_tokens=n, stop_at="\n"))
    after = model.stats.snapshot()
    print(f"streamed      : {streamed!r}")
    print(f"forwarded {after['tokens_forwarded'] - before['tokens_forwarded']} tokens, "
          f"{after['tokens_rewound'] - before['tokens_rewound']} of them taken back by rewinds")
    clean = not any(b.lower() in streamed.lower() for b in banned)
    print(f"banned text in the answer: {'none' if clean else 'FOUND'}")


if __name__ == "__main__":
    main()
