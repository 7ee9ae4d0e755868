"""Cost of a JSON constraint per token, against free text and against outlines; generator build time.

Every figure is decoding only: ours continue a prefilled state; outlines' prefill (a
call of one token) is subtracted from its calls.

    python benchmarks/constraint.py [--quick] [--save] [--reps N]
"""

from __future__ import annotations

from common import count_positions, emit, median, random_text, setup, timed
from pydantic import BaseModel

from continuous import continuous, generate
from continuous.engines import caches


class Item(BaseModel):
    name: str
    quantity: int
    tags: list[str]


def main():
    import outlines

    args, size, hf, tok, model = setup(__doc__)
    n = 16 if args.quick else 64

    # Build times: cold clears the in-memory caches; warm builds the same generator again.
    caches.clear()
    _, cold = timed(lambda: generate.json(model, Item))
    warm = median([timed(lambda: generate.json(model, Item))[1] for _ in range(5)])

    # Token by token: this measures what masking costs (fastforward.py measures forced tokens).
    json_gen = continuous(generate.json(model, Item), fast_forward=False)
    text_gen = continuous(generate.text(model))
    prompt = random_text(tok, 32, seed=3) + "\nAn item as JSON:\n"
    # Prefilled once (max_tokens=0 forwards the prompt): both time decoding only.
    base = text_gen(prompt, max_tokens=0)
    o_gen = outlines.Generator(outlines.from_transformers(hf, tok), Item)
    o_gen(prompt, max_new_tokens=2)  # outlines' mask kernel compiles on its first call

    per_token = {"unconstrained": [], "json": [], "outlines_json": []}
    for _ in range(args.reps):
        for name, gen in (("unconstrained", text_gen), ("json", json_gen)):
            before = model.stats.forward_calls
            _, t = timed(lambda: gen(base, max_tokens=n))
            # per forward: a row that ends early (EOS) is not charged for tokens it skipped
            per_token[name].append(t / max(1, model.stats.forward_calls - before))
        # outlines prefills the prompt on every call: a call of one token times that
        # prefill (and the first step), and the difference leaves decoding alone.
        with count_positions(hf) as counter:
            _, t1 = timed(lambda: o_gen(prompt, max_new_tokens=1))
        calls1 = counter["calls"]
        with count_positions(hf) as counter:
            _, t = timed(lambda: o_gen(prompt, max_new_tokens=n))
        per_token["outlines_json"].append((t - t1) / max(1, counter["calls"] - calls1))
    ms = {k: round(median(v) * 1e3, 3) for k, v in per_token.items()}
    table = [("", "ms/token (median)"), *[(k, f"{v:.2f}") for k, v in ms.items()],
             ("json / unconstrained", f"{ms['json'] / ms['unconstrained']:.3f}"),
             ("build cold ms", f"{cold * 1e3:.1f}"), ("build warm ms", f"{warm * 1e3:.3f}")]
    result = {"bench": "constraint", "model": size, "tokens": n, "ms_per_token": ms,
              "build_ms": {"cold": round(cold * 1e3, 2), "warm": round(warm * 1e3, 3)},
              "bars": {"json_vs_unconstrained": round(ms["json"] / ms["unconstrained"], 3),
                       "warm_build_under_5ms": warm * 1e3 < 5}}
    emit("constraint", table, result, args.save)


if __name__ == "__main__":
    main()
