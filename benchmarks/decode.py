"""Decode time per token at a short and a long context: continuous against an HF DynamicCache loop.

    python benchmarks/decode.py [--quick] [--save]

Both greedy-decode the same number of tokens after the same prefilled prompt,
interleaved; the table shows medians of the per-token time.
"""

from __future__ import annotations

import time

import torch
from common import emit, median, random_text, setup, timed
from transformers import DynamicCache

from continuous import continuous, generate
from continuous.kv import CACHE_ARG


def hf_decode(model, ids, n):
    """Prefill then greedy-decode ``n`` tokens with one DynamicCache; returns decode seconds."""
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        out = model(ids, **{CACHE_ARG: cache}, use_cache=True, logits_to_keep=1)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        start = time.perf_counter()
        for _ in range(n):
            token = model(token, **{CACHE_ARG: cache}, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
    return time.perf_counter() - start


def main():
    args, size, hf, tok, model = setup(__doc__)
    gen = continuous(generate.text(model))
    n = 16 if args.quick else 64
    rows = [("context", "continuous ms/token", "HF DynamicCache ms/token", "ratio")]
    result = {"bench": "decode", "model": size, "ms_per_token": {}}
    for context in (100, 1000):
        base = gen(random_text(tok, context, seed=context), max_tokens=1)  # prefill: time only decoding
        ids = torch.tensor([base._rows.real_ids(0)])
        ours, theirs = [], []
        for _ in range(args.reps):
            # n forwards: the base's last token (a top-up), then n - 1 sampled tokens.
            ours.append(timed(lambda: gen(base, max_tokens=n))[1] / n)
            theirs.append(hf_decode(hf, ids, n) / n)
        a, b = median(ours) * 1e3, median(theirs) * 1e3
        rows.append((ids.shape[1], f"{a:.2f}", f"{b:.2f}", f"{a / b:.2f}"))
        result["ms_per_token"][str(context)] = {"continuous": round(a, 3), "hf": round(b, 3)}
    emit("decode", rows, result, args.save)


if __name__ == "__main__":
    main()
