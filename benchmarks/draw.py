"""One step's choice of tokens on a CPU at real vocabulary sizes: the library's samplers
against transformers' logits processors doing the same work.

    python benchmarks/draw.py [--quick] [--save] [--reps N]

16 rows of random logits, one torch thread, for each vocabulary (SmolLM2's 49,152 and
Llama-3's 128,256 tokens; ``--quick``: 2,048 and 49,152) and each kind of step:

- ``greedy``: the likeliest token (transformers: ``argmax``);
- ``sample``: a sample at temperature 1 (transformers: ``softmax`` then ``torch.multinomial``);
- ``top_p``: temperature 0.7 and top-p 0.9 (transformers: its temperature and top-p
  warpers, then ``softmax`` and ``torch.multinomial``);
- ``mask``: a constraint that allows 30% of the tokens, then greedy (transformers: the
  boolean mask given unpacked, ``masked_fill`` and ``argmax``; the library starts from
  the packed bitmask its constraints write).

The library also returns each token's log-probability (the state's weight), which
transformers' loop does not compute. Milliseconds per step, medians of the reps, and
``vs_transformers``: transformers' time over the library's.
"""

from __future__ import annotations

import time

import torch
from common import emit, median, parse_args
from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

from continuous import samplers
from continuous.engines import bits

ROWS = 16


def library(kind: str, logits: torch.Tensor, packed: torch.Tensor, rng: torch.Generator):
    weights = torch.zeros(ROWS)
    if kind == "greedy":
        return samplers.greedy()(logits, weights)
    if kind == "sample":
        return samplers.multinomial()(logits, weights, rng)
    if kind == "top_p":
        return samplers.multinomial(temperature=0.7, top_p=0.9)(logits, weights, rng)
    return samplers.greedy()(logits + bits.bias(packed, logits.shape[-1]), weights)


def transformers_way(kind: str, logits: torch.Tensor, allowed: torch.Tensor, rng: torch.Generator):
    if kind == "greedy":
        return logits.argmax(-1)
    if kind == "sample":
        return torch.multinomial(torch.softmax(logits, -1), 1, generator=rng)
    if kind == "top_p":
        scores = TopPLogitsWarper(0.9)(None, TemperatureLogitsWarper(0.7)(None, logits))
        return torch.multinomial(torch.softmax(scores, -1), 1, generator=rng)
    return logits.masked_fill(~allowed, -torch.inf).argmax(-1)


def timed_ms(fn, reps: int) -> float:
    fn()  # warm up
    times = []
    for _ in range(reps):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return round(1e3 * median(times), 3)


def main():
    args = parse_args(__doc__)
    torch.set_num_threads(1)
    vocabularies = (2048, 49152) if args.quick else (49152, 128256)
    reps = max(args.reps, 1) * (1 if args.quick else 5)
    result = {"bench": "draw", "rows": ROWS, "threads": 1, "ms_per_step": {}}
    rows = [("vocabulary", "kind", "library ms", "transformers ms", "vs transformers")]
    for vocab in vocabularies:
        gen = torch.Generator().manual_seed(vocab)
        logits = torch.randn(ROWS, vocab, generator=gen) * 3
        allowed = torch.rand(ROWS, vocab, generator=gen) < 0.3
        packed = torch.zeros(ROWS, bits.words(vocab), dtype=torch.int32)
        for r in range(ROWS):
            bits.pack(allowed[r].nonzero().flatten().tolist(), packed[r], vocab)
        figures = {}
        for kind in ("greedy", "sample", "top_p", "mask"):
            rng = torch.Generator().manual_seed(0)
            ours = timed_ms(lambda: library(kind, logits, packed, rng), reps)
            theirs = timed_ms(lambda: transformers_way(kind, logits, allowed, rng), reps)
            figures[kind] = {"library": ours, "transformers": theirs, "vs_transformers": round(theirs / ours, 2)}
            rows.append((vocab, kind, ours, theirs, figures[kind]["vs_transformers"]))
        result["ms_per_step"][str(vocab)] = figures
    emit("draw", rows, result, args.save)


if __name__ == "__main__":
    main()
