"""Slices, appends and sums of a long state, continued: tokens forwarded against the bound, and time
against doing the same after drop_cache().

    python benchmarks/stateops.py [--quick] [--save] [--reps N]

Bounds, per operation continued by ``new`` tokens (the last one is sampled, not forwarded):
- slice at character M: the tokens re-encoded after the last whole token before M, plus
  that token (its logits were cut off), plus ``new - 1``;
- append of a text: its tokens, plus the merge at the boundary (re-encoded old tokens),
  plus the state's last token (sampled, never forwarded), plus ``new - 1``;
- sum: the right operand's tokens plus the same boundary terms.

``expected`` is the exact count, derived from the token ids alone: the state's tokens
that the base's cache cannot cover (those past the common prefix of their ids; the
base's last, sampled, token was never forwarded; the last token is forwarded again when
its logits were cut off), plus each generated token but the last. Each operation is
timed ``--reps`` times, cached and recomputed in turn (alternating which goes first).
"""

from __future__ import annotations

import random
import warnings

from common import emit, median, random_text, setup, timed

from continuous import CacheResetWarning, continuous, generate


def main():
    args, size, hf, tok, model = setup(__doc__)
    gen = continuous(generate.text(model))
    length, n_slices, n_appends, n_sums, new = (200, 4, 4, 2, 4) if args.quick else (600, 20, 20, 10, 8)
    base = gen(random_text(tok, length - 1, seed=5), max_tokens=1)
    text = str(base)
    base_tokens = len(base._rows.real_ids(0))
    rng = random.Random(0)
    appendix = [random_text(tok, 40, seed=100 + i) for i in range(n_appends)]
    ops = [("slice", rng.randrange(1, len(text))) for _ in range(n_slices)]
    ops += [("append", a) for a in appendix] + [("sum", None)] * n_sums

    results = []
    for op, arg in ops:
        if op == "slice":
            state = base[:arg]
            whole = sum(1 for e in base._rows.ends[0] if e <= arg)
            bound = len(tok(text[:arg]).input_ids) - whole + 1 + new - 1
        elif op == "append":
            state = base + arg
            added = len(tok(arg, add_special_tokens=False).input_ids)
            bound = added + 2 + 1 + new - 1  # up to 2 tokens of merge at the boundary
        else:
            state = base + base
            bound = base_tokens - 1 + 2 + 1 + new - 1
        fresh = state.drop_cache()
        runs = {"cached": (state, []), "recompute": (fresh, [])}
        forwarded = set()
        for rep in range(args.reps):
            # Interleaved, and alternating who goes first, so that neither competitor
            # always runs on a warmer (or busier) machine.
            for name in (("cached", "recompute") if rep % 2 == 0 else ("recompute", "cached")):
                start, times = runs[name]
                before = model.stats.tokens_forwarded
                out, seconds = timed(lambda: gen(start, max_tokens=new))
                times.append(seconds)
                if name == "cached":
                    forwarded.add(model.stats.tokens_forwarded - before)
        ids, base_ids = state._rows.real_ids(0), base._rows.real_ids(0)
        common = next((i for i, (a, b) in enumerate(zip(ids, base_ids)) if a != b), min(len(ids), len(base_ids)))
        covered = min(common, len(base_ids) - 1, len(ids) - 1)
        generated = len(out._rows.real_ids(0)) - len(ids)
        expected = len(ids) - covered + max(0, generated - 1)
        results.append({"op": op, "tokens_forwarded": max(forwarded), "expected": expected, "bound": bound,
                        "same_every_rep": len(forwarded) == 1,
                        "seconds": round(median(runs["cached"][1]), 4),
                        "seconds_recompute": round(median(runs["recompute"][1]), 4)})

    table = [("op", "count", "max tokens over bound", "median tokens", "median s", "median s recompute",
              "speedup")]
    for op in ("slice", "append", "sum"):
        rows = [r for r in results if r["op"] == op]
        over = max(r["tokens_forwarded"] - r["bound"] for r in rows)
        s, s_re = median([r["seconds"] for r in rows]), median([r["seconds_recompute"] for r in rows])
        table.append((op, len(rows), over, median([r["tokens_forwarded"] for r in rows]), f"{s:.3f}",
                      f"{s_re:.3f}", f"{s_re / s:.1f}x"))
    result = {"bench": "stateops", "model": size, "state_tokens": base_tokens, "ops": results,
              "bars": {"all_within_bound": all(r["tokens_forwarded"] <= r["bound"] for r in results),
                       "all_exact": all(r["tokens_forwarded"] == r["expected"] for r in results)}}
    emit("stateops", table, result, args.save)


if __name__ == "__main__":
    warnings.simplefilter("ignore", CacheResetWarning)
    main()
