"""Greedy decoding against the memory-bandwidth floor measured in the same run.

    python benchmarks/floor.py [--quick] [--save] [--reps N]

At batch 1 a decode step reads every weight it uses once, so those bytes / bandwidth
is the least time a token can take. A step reads one row of the input embedding, not
the table, so the table is left out (as gpt-fast counts) unless it is tied to the LM
head, which reads all of it. Bandwidth is measured with a large tensor copy (bytes read
plus bytes written, per second). A bare sweep of one GEMV per weight matrix shows what
torch's kernels reach on these cores, with no model around them.
"""

from __future__ import annotations

import torch
from common import emit, median, random_text, setup, timed

from continuous import continuous, generate


def bandwidth(n_bytes: int = 1 << 30, reps: int = 5) -> float:
    a = torch.ones(n_bytes // 4)
    b = torch.empty_like(a)
    b.copy_(a)  # touch the pages first
    best = min(timed(lambda: b.copy_(a))[1] for _ in range(reps))
    return 2 * n_bytes / best


def _input_embedding(hf) -> tuple[torch.Tensor, bool]:
    """The input embedding table, and whether the LM head is tied to it (then a step reads it all)."""
    embedding = hf.get_input_embeddings().weight
    head = hf.get_output_embeddings()
    return embedding, head is not None and head.weight is embedding


def step_weight_bytes(hf) -> int:
    """Bytes of the weights one decode step of one token reads.

    Parameters
    ----------
    hf
        A transformers causal LM.

    Returns
    -------
    int
        Every parameter once (tied ones once), less the input embedding table plus the
        one row a token looks up; a table tied to the LM head counts whole.
    """
    embedding, tied = _input_embedding(hf)
    total = sum(p.numel() * p.element_size() for p in hf.parameters())
    if tied:
        return total
    return total - embedding.numel() * embedding.element_size() + embedding[0].numel() * embedding.element_size()


def gemv_sweep(hf) -> float:
    """Seconds of a bare sweep over the weights a step reads: one GEMV per weight matrix.

    What torch's own kernels reach on these cores with no model around them (no
    attention, norms, Python or cache): the floor that a torch decode can approach.
    """
    embedding, tied = _input_embedding(hf)
    weights = [p for p in hf.parameters() if p.dim() == 2 and (p is not embedding or tied)]
    inputs = {w.shape[1]: torch.randn(1, w.shape[1], dtype=w.dtype) for w in weights}

    def sweep():
        for w in weights:
            torch.nn.functional.linear(inputs[w.shape[1]], w)

    with torch.inference_mode():
        sweep()  # warm
        return min(timed(sweep)[1] for _ in range(20))


def main():
    args, size, hf, tok, model = setup(__doc__)
    gen = continuous(generate.text(model))
    n = 32 if args.quick else 128
    weight_bytes = step_weight_bytes(hf)
    base = gen(random_text(tok, 32, seed=9), max_tokens=0)
    per_token, floors, sweeps = [], [], []
    for _ in range(args.reps):
        floors.append(weight_bytes / bandwidth())
        sweeps.append(gemv_sweep(hf))
        before = model.stats.forward_calls
        _, t = timed(lambda: gen(base, max_tokens=n))
        per_token.append(t / (model.stats.forward_calls - before))
    ms, floor_ms, sweep_ms = median(per_token) * 1e3, median(floors) * 1e3, median(sweeps) * 1e3
    table = [("", "ms/token"), ("greedy decode", f"{ms:.2f}"), ("bandwidth floor", f"{floor_ms:.2f}"),
             ("ratio", f"{ms / floor_ms:.2f}"), ("bare GEMV sweep", f"{sweep_ms:.2f}"),
             ("sweep / floor", f"{sweep_ms / floor_ms:.2f}"), ("decode / sweep", f"{ms / sweep_ms:.2f}"),
             ("weights MB", f"{weight_bytes / 1e6:.0f}")]
    result = {"bench": "floor", "model": size, "ms_per_token": round(ms, 3),
              "floor_ms_per_token": round(floor_ms, 3), "gemv_sweep_ms": round(sweep_ms, 3),
              "bars": {"ratio": round(ms / floor_ms, 3), "sweep_vs_floor": round(sweep_ms / floor_ms, 3),
                       "decode_vs_sweep": round(ms / sweep_ms, 3)}}
    emit("floor", table, result, args.save)


if __name__ == "__main__":
    main()
