"""Decode time per token at a short and a long context: continuous against an HF DynamicCache loop.

    python benchmarks/decode.py [--quick]

Both greedy-decode the same number of tokens from the same prompt, interleaved; the
table shows medians of the per-token time.
"""

from __future__ import annotations

import argparse

import torch
from transformers import DynamicCache

from common import emit, median, reference_model, timed
from continuous import continuous, generate, models


def hf_loop(model, ids, n):
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        out = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(n - 1):
            out = model(token, past_key_values=cache, use_cache=True)
            token = out.logits[:, -1].argmax(-1, keepdim=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    size = "small" if args.quick else "mid"
    hf, tok, _ = reference_model(size)
    torch.set_num_threads(2)
    model = models.transformers(hf, tok)
    gen = continuous(generate.text(model))
    n = 16 if args.quick else 64
    rows = [("context", "continuous ms/token", "hf DynamicCache ms/token", "ratio")]
    result = {"bench": "decode", "model": size, "ms_per_token": {}}
    for context in (100, 1000):
        prompt_ids = torch.randint(3, len(tok), (1, context), generator=torch.Generator().manual_seed(0))
        prompt = tok.decode(prompt_ids[0])
        base = gen(prompt, max_tokens=1)  # prefill once: time only decoding
        ids = torch.tensor([base._rows.real_ids(0)])
        ours, theirs = [], []
        for _ in range(3):
            _, t = timed(lambda: gen(base, max_tokens=n + 1))
            ours.append(t / n)
            _, t0 = timed(lambda: hf_loop(hf, ids, 1))
            _, t = timed(lambda: hf_loop(hf, ids, n + 1))
            theirs.append((t - t0) / n)
        a, b = median(ours) * 1e3, median(theirs) * 1e3
        rows.append((base._rows.attention_mask.shape[1], f"{a:.2f}", f"{b:.2f}", f"{a / b:.2f}"))
        result["ms_per_token"][str(context)] = {"continuous": round(a, 3), "hf": round(b, 3)}
    emit(rows, result)


if __name__ == "__main__":
    main()
