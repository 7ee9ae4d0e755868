"""Greedy decoding against the memory-bandwidth floor measured in the same run.

    python benchmarks/floor.py [--quick] [--save] [--reps N]

At batch 1 a decode step reads every weight once, so weight bytes / bandwidth is the
least time a token can take. Bandwidth is measured with a large tensor copy (bytes
read plus bytes written, per second).
"""

from __future__ import annotations

import torch

from common import setup, emit, median, random_text, timed
from continuous import continuous, generate


def bandwidth(n_bytes: int = 1 << 30, reps: int = 5) -> float:
    a = torch.ones(n_bytes // 4)
    b = torch.empty_like(a)
    b.copy_(a)  # touch the pages first
    best = min(timed(lambda: b.copy_(a))[1] for _ in range(reps))
    return 2 * n_bytes / best


def main():
    args, size, hf, tok, model = setup(__doc__)
    gen = continuous(generate.text(model))
    n = 32 if args.quick else 128
    weight_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
    base = gen(random_text(tok, 32, seed=9), max_tokens=0)
    per_token, floors = [], []
    for _ in range(args.reps):
        floors.append(weight_bytes / bandwidth())
        before = model.stats.forward_calls
        _, t = timed(lambda: gen(base, max_tokens=n))
        per_token.append(t / (model.stats.forward_calls - before))
    ms, floor_ms = median(per_token) * 1e3, median(floors) * 1e3
    table = [("", "ms/token"), ("greedy decode", f"{ms:.2f}"), ("bandwidth floor", f"{floor_ms:.2f}"),
             ("ratio", f"{ms / floor_ms:.2f}"), ("weights MB", f"{weight_bytes / 1e6:.0f}")]
    result = {"bench": "floor", "model": size, "ms_per_token": round(ms, 3),
              "floor_ms_per_token": round(floor_ms, 3), "bars": {"ratio": round(ms / floor_ms, 3)}}
    emit("floor", table, result, args.save)


if __name__ == "__main__":
    main()
