"""Fast-forward: forced tokens forwarded together, against token by token and free text.

    python benchmarks/fastforward.py [--quick] [--save] [--reps N]

The ``constraint`` workload (64 tokens under the schema of ``constraint.py``, from a
prefilled prompt), written compactly (``whitespace_pattern=""``: where a schema forces
keys and punctuation, free whitespace would leave nothing forced). Time is per output
token: forwarding a forced run in one call is what saves time.
"""

from __future__ import annotations

from common import emit, median, random_text, setup, timed
from constraint import Item

from continuous import continuous, generate


def main():
    args, size, hf, tok, model = setup(__doc__)
    n = 16 if args.quick else 64
    prompt = random_text(tok, 32, seed=3) + "\nAn item as JSON:\n"
    gens = {
        "free": continuous(generate.text(model)),
        "json": continuous(generate.json(model, Item, whitespace_pattern=""), fast_forward=False),
        "json_ff": continuous(generate.json(model, Item, whitespace_pattern=""), fast_forward=True),
    }
    base = gens["free"](prompt, max_tokens=0)  # prefilled once: every competitor times decoding only
    per_token = {k: [] for k in gens}
    calls, tokens = {}, {}
    for _ in range(args.reps):
        for name, gen in gens.items():
            before = model.stats.forward_calls
            state, t = timed(lambda: gen(base, max_tokens=n))
            out = int(state.attention_mask.sum()) - int(base.attention_mask.sum())
            per_token[name].append(t / max(1, out))
            calls[name], tokens[name] = model.stats.forward_calls - before, out
    ms = {k: round(median(v) * 1e3, 3) for k, v in per_token.items()}
    table = [("", "ms/output token", "forward calls", "tokens")]
    table += [(k, f"{ms[k]:.2f}", calls[k], tokens[k]) for k in gens]
    result = {"bench": "fastforward", "model": size, "ms_per_output_token": ms,
              "forward_calls": {"json": calls["json"], "json_ff": calls["json_ff"]}, "tokens": tokens["json_ff"],
              "bars": {"json_ff_below_free": ms["json_ff"] < ms["free"],
                       "same_tokens": tokens["json"] == tokens["json_ff"]}}
    emit("fastforward", table, result, args.save)


if __name__ == "__main__":
    main()
