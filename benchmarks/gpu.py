"""The GPU workload: decode, multiturn, JSON, a long prompt and a fork on a Llama-3.2-1B shape.

    python benchmarks/gpu.py [--device cuda] [--quick] [--save] [--reps N] [--only SECTIONS]

The model is a random-weight Llama-3.2-1B shape (hidden 2048, 16 layers, 32 heads,
8 kv heads, intermediate 8192, tied embeddings) in bf16 with the real Llama-3
tokenizer (llama.cpp's vocab file, converted offline). Competitors run interleaved in
one process and get the same ids, prefill, dtype and max tokens; each runs once before
it is timed (compiling, choosing attention kernels), so that few ``--reps`` still time warm runs:

- decode: 128 greedy tokens after a 512-token prompt, prefilled (decode time only),
  eager and with ``compile=True`` (compiled steps, CUDA graphs on a GPU), against HF ``generate`` with its dynamic cache and with ``cache_implementation="static"``
  (which compiles), and the HBM floor: bytes of the weights a step reads (the input
  embedding excluded unless tied, since the head reads it) / measured copy bandwidth;
- multiturn: the ``multiturn`` benchmark's workload, eager and compiled, against the
  ideal loop and outlines (both eager: neither has a compiled path for it);
- constraint: 64 tokens under the ``constraint`` benchmark's schema against free text,
  eager and compiled, with JSON as is and written compactly (as the
  ``fastforward`` benchmark: forced runs in one step, compiled at widths up to 8);
- long: a 15k-token prompt + 16 tokens: seconds (from text, tokenizing included) and
  peak memory above the weights, against HF ``generate``; each warmed up once;
- fork: 8 samples x 32 tokens from a 512-token prompt, against HF ``generate``'s
  sampling with ``num_return_sequences=8``;
- real: the ``real`` benchmark's workloads (multi-turn chat and JSON extraction on the
  trained SmolLM2-135M-Instruct, in bf16), eager and compiled.

``--device cpu --quick`` runs a small shape on the CPU so that the script is tested
where there is no GPU; its figures say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import time

import torch
from common import emit, median, random_text

from continuous import continuous, generate, models, samplers

LLAMA_1B = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                intermediate_size=8192, tie_word_embeddings=True)
SMALL = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=512, tie_word_embeddings=True)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="small shape and sizes (a smoke run)")
    parser.add_argument("--save", action="store_true", help="write benchmarks/results/gpu.json")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--only", help="comma-separated sections: decode,multiturn,constraint,long,fork,real")
    return parser.parse_args()


def build(device: str, quick: bool):
    from support.models import real_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = real_tokenizer("llama-bpe")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    config = LlamaConfig(**(SMALL if quick else LLAMA_1B), vocab_size=len(tok), max_position_embeddings=16384,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    with torch.device(device):
        hf = LlamaForCausalLM(config).to(dtype).eval()
    return hf, tok


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def clock(device, fn):
    sync(device)
    t = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t


def step_bytes(hf) -> int:
    """Bytes of the weights one decode step reads: all but an input embedding the head does not share."""
    total = sum(p.numel() * p.element_size() for p in hf.parameters())
    emb, head = hf.get_input_embeddings().weight, hf.get_output_embeddings().weight
    if emb.data_ptr() != head.data_ptr():
        total -= emb.numel() * emb.element_size()
    return total


def bandwidth(device, n_bytes=1 << 30, reps=5) -> float:
    a = torch.ones(n_bytes // 4, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    best = min(clock(device, lambda: b.copy_(a))[1] for _ in range(reps))
    return 2 * n_bytes / best


def hf_decode(hf, ids, n, device, **kwargs):
    """Seconds per token of HF generate's decode: (n tokens - 1 token) / (n - 1)."""
    def run(k):
        return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=k, min_new_tokens=k,
                           do_sample=False, pad_token_id=hf.config.eos_token_id, **kwargs)
    run(n)  # warm up (and compile, for the static cache)
    _, one = clock(device, lambda: run(1))
    _, full = clock(device, lambda: run(n))
    return (full - one) / (n - 1)


def main():
    args = parse_args()
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --device cpu (a smoke run) or on a GPU")
    hf, tok = build(device, args.quick)
    model = models.transformers(hf, tok)
    n_decode, prompt_len, long_len = (16, 64, 512) if args.quick else (128, 512, 15000)
    compiled = models.transformers(hf, tok, compile=True)
    want = set(args.only.split(",")) if args.only else {"decode", "multiturn", "constraint", "long", "fork", "real"}
    r = lambda x: None if x is None else round(x, 3)  # noqa: E731
    table = [("", "continuous", "reference", "ratio")]
    result = {"bench": "gpu", "device": device, "quick": args.quick}

    def row(label, ours, ref):
        table.append((label, r(ours), r(ref), r(ours / ref) if ours and ref else "-"))

    if "decode" in want:  # eager, and with compiled decode steps (CUDA graphs on a GPU)
        d = result["decode_ms"] = {k: r(v) for k, v in decode(hf, tok, model, compiled, prompt_len, n_decode,
                                                                    args, device).items()}
        row("decode ms/token vs HF static", d["continuous"], d["hf_static"])
        row("decode ms/token vs HF dynamic", d["continuous"], d["hf_dynamic"])
        row("decode ms/token vs floor", d["continuous"], d["floor"])
        row("compiled decode vs HF static", d["continuous_compiled"], d["hf_static"])
        row("compiled decode vs floor", d["continuous_compiled"], d["floor"])
    # multiturn, JSON and fork reuse the CPU benchmarks' workloads, eager and compiled
    if "multiturn" in want:
        m = result["multiturn_s"] = {k: r(v) for k, v in multiturn(
            hf, tok, {"continuous": model, "continuous_compiled": compiled}, args, device).items()}
        for name in ("continuous", "continuous_compiled"):
            label = "multiturn s" + (" (compiled)" if "compiled" in name else "")
            row(f"{label} vs ideal", m[name], m["ideal"])
            row(f"{label} vs outlines", m[name], m["outlines"])
    if "constraint" in want:
        c = result["constraint_ms"] = {k: r(v) for k, v in constraint(
            {"": model, "_compiled": compiled}, tok, args, device).items()}
        for suffix in ("", "_compiled"):
            row(f"JSON vs free ms/token{suffix.replace('_', ' ')}", c["json" + suffix], c["free" + suffix])
            row(f"JSON fast-forward vs free ms/token{suffix.replace('_', ' ')}", c["json_ff" + suffix],
                c["free" + suffix])
    if "long" in want:
        long = result["long"] = long_prompt(hf, tok, model, long_len, device)
        row(f"{long_len}-token prompt s", long["seconds"]["continuous"], long["seconds"]["hf"])
        if long["peak_mb"]["hf"]:
            row("peak MB above weights", long["peak_mb"]["continuous"], long["peak_mb"]["hf"])
    if "fork" in want:
        f = result["fork_s"] = {k: r(v) for k, v in fork(hf, model, tok, args, device).items()}
        row("fork 8 x 32 s vs HF sampling", f["continuous"], f["hf"])
    if "real" in want:
        real = result["real"] = real_model(args, device)
        for suffix in ("", "_compiled"):
            chat, extraction = real["multiturn" + suffix]["seconds"], real["json" + suffix]["ms_per_output_token"]
            label = "SmolLM2" + suffix.replace("_", " ")
            row(f"{label} chat s vs ideal", chat["continuous"], chat["ideal"])
            row(f"{label} chat s vs outlines", chat["continuous"], chat["outlines"])
            row(f"{label} JSON fast-forward vs free ms/token", extraction["json_ff"], extraction["free"])
    emit("gpu", table, result, args.save)


def real_model(args, device):
    """The ``real`` benchmark's chat and extraction on SmolLM2, eager and compiled."""
    from real import extraction, multiturn
    from support.real import smollm2

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    out = {}
    for suffix, compiled in (("", False), ("_compiled", True)):
        model = models.transformers(smollm2(), device=device, dtype=dtype, compile=compiled)
        out["multiturn" + suffix] = multiturn(model, args)
        out["json" + suffix] = extraction(model, args)
    return out


def decode(hf, tok, model, compiled, prompt_len, n_decode, args, device):
    """ms per decoded token: continuous eager and compiled, HF generate dynamic and static, the floor."""
    prompt = random_text(tok, prompt_len, seed=3)
    ids = tok(prompt, return_tensors="pt").input_ids.to(device)
    floor = step_bytes(hf) / bandwidth(device)
    gen, gen_c = continuous(generate.text(model)), continuous(generate.text(compiled))
    for g in (gen, gen_c):  # warm up: compiles the compiled shapes, picks the eager attention kernels
        g(g(prompt, max_tokens=0), max_tokens=n_decode)
    ours, ours_c, dyn, static = [], [], [], []
    with torch.no_grad():
        for _ in range(args.reps):
            for g, out in ((gen, ours), (gen_c, ours_c)):
                base = g(prompt, max_tokens=0)
                state, t = clock(device, lambda: g(base, max_tokens=n_decode))
                # Per token after the first, as for HF: the first needs no forward.
                out.append(t / (state.token_ids.shape[1] - base.token_ids.shape[1] - 1))
            dyn.append(hf_decode(hf, ids, n_decode, device))
            if device == "cuda":
                static.append(hf_decode(hf, ids, n_decode, device, cache_implementation="static"))
    return {"continuous": median(ours) * 1e3, "continuous_compiled": median(ours_c) * 1e3,
            "hf_dynamic": median(dyn) * 1e3, "hf_static": median(static) * 1e3 if static else None,
            "floor": floor * 1e3}


def multiturn(hf, tok, ours, args, device):
    """Seconds of the multiturn workload: each of ``ours`` (name -> model), the ideal loop and outlines."""
    from multiturn import competitors

    runs = {}
    for name, m in ours.items():
        theirs, _ = competitors(hf, tok, m, args.quick)
        runs[name] = theirs.pop("continuous")
    runs.update(theirs)
    seconds = {name: [] for name in runs}
    for run in runs.values():  # warm up (compiles a compiled model's shapes): a median of few reps keeps a cold run
        run()
    for _ in range(args.reps):
        for name, run in runs.items():
            seconds[name].append(clock(device, run)[1])
    return {k: median(v) for k, v in seconds.items()}


def constraint(ours, tok, args, device):
    """ms per output token of free text and of JSON, for each of ``ours`` (suffix -> model)."""
    from constraint import Item

    n = 16 if args.quick else 64
    prompt = random_text(tok, 128, seed=5) + "\nA record as JSON: "
    out = {}
    for suffix, model in ours.items():
        for name, g, ff in (("free", generate.text(model), False), ("json", generate.json(model, Item), True),
                            ("json_ff", generate.json(model, Item, whitespace_pattern=""), True)):
            gen = continuous(g, fast_forward=ff)
            base = gen(prompt, max_tokens=0)
            gen(base, max_tokens=n)  # warm up (compiles the shapes of a compiled model)
            per = []
            for _ in range(args.reps):
                state, t = clock(device, lambda: gen(base, max_tokens=n))
                per.append(t / max(1, len(state.token_ids[0]) - len(base.token_ids[0])))
            out[name + suffix] = median(per) * 1e3
    return out


def fork(hf, model, tok, args, device):
    """Seconds of 8 samples x 32 tokens from one prompt: continuous and HF generate's sampling."""
    prompt = random_text(tok, 64 if args.quick else 512, seed=7)
    ids = tok(prompt, return_tensors="pt").input_ids.to(device)
    gen = continuous(generate.text(model, samplers.multinomial(8)))
    runs = {"continuous": lambda s: gen(prompt, max_tokens=32, seed=s),
            "hf": lambda s: hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, top_k=0,
                                        num_return_sequences=8, max_new_tokens=32, min_new_tokens=32,
                                        pad_token_id=hf.config.eos_token_id)}
    for run in runs.values():
        run(0)  # warm up
    return {name: median([clock(device, lambda: run(s))[1] for s in range(1, args.reps + 1)])
            for name, run in runs.items()}


def long_prompt(hf, tok, model, n_tokens, device):
    """A long prompt + 16 tokens: seconds (text in, tokenization included for both) and peak memory."""
    prompt = random_text(tok, n_tokens, seed=11)
    gen = continuous(generate.text(model))

    def hf_run():
        ids = tok(prompt, return_tensors="pt").input_ids.to(device)
        return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                           pad_token_id=hf.config.eos_token_id)

    runs = {"continuous": lambda: gen(prompt, max_tokens=16), "hf": hf_run}
    for run in runs.values():
        run()  # warm up: attention kernels for this length are chosen on the first call
    weights = torch.cuda.memory_allocated() if device == "cuda" else 0
    seconds, peak = {}, {}
    for name, fn in runs.items():
        if device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        _, seconds[name] = clock(device, fn)
        peak[name] = (torch.cuda.max_memory_allocated() - weights) / 2**20 if device == "cuda" else None
    return {"tokens": len(tok(prompt).input_ids), "seconds": {k: round(v, 3) for k, v in seconds.items()},
            "peak_mb": {k: None if v is None else round(v, 1) for k, v in peak.items()}}


if __name__ == "__main__":
    main()
