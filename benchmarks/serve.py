"""Many callers on one model: concurrency, re-sent chat history, latency.

    python benchmarks/serve.py [--quick] [--save] [--reps N] [--threads T] [--model mid|smollm2|both]

Run it alone: its figures are throughput and latency.

- concurrency: 1, 4, 8 and 16 clients, each a 64-token greedy completion of its own
  prompt (a different one per client), through the library (``acall`` from coroutines
  on one model; concurrent calls share forward passes). Aggregate generated tokens per
  second, and its ratio to one client. The same 16 prompts through transformers'
  ``generate_batch`` (its continuous batching, same max tokens, greedy, fp32, threads).
- chat: eight turns whose prompt re-sends the whole history (as an OpenAI client does),
  with the prefix cache on and off: prompt tokens forwarded against the ideal (each
  turn's new tokens only), and seconds.
- latency: at 16 clients, p50 and p99 time to first token and time per output token
  (``astream``).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import torch
from common import emit, median, reference_model

from continuous import chat, continuous, generate, models

CLIENTS = (1, 4, 8, 16)
TOPICS = ["Lima", "Oslo", "Kyoto", "Perth", "Cairo", "Quito", "Dakar", "Porto", "Paris", "Lagos", "Rome",
          "Seoul", "Hanoi", "Accra", "Sofia", "Tunis"]


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="the small random model, fewer tokens")
    parser.add_argument("--save", action="store_true", help="write benchmarks/results/serve.json")
    parser.add_argument("--reps", type=int, default=2, help="repetitions of each measurement (median)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--model", default="both", choices=["mid", "smollm2", "both"])
    return parser.parse_args()


def load(name: str, quick: bool):
    """(HF model, tokenizer, chat-capable) of a benchmark model."""
    if quick:
        hf, tok, _ = reference_model("small")
        return hf, tok
    if name == "mid":
        hf, tok, _ = reference_model("mid")
        return hf, tok
    from support.real import smollm2
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2()
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)


def prompts(tok, n: int) -> list[str]:
    if tok.chat_template:
        return [chat.prompt(tok, [{"role": "user", "content": f"Tell me about {t}."}]) for t in TOPICS[:n]]
    return [f"User: tell me about {t}.\nAssistant:" for t in TOPICS[:n]]


def generated(state) -> int:
    return sum(len(lp) for lp in state.logprobs) if state.logprobs is not None else 0


def concurrency(model, texts: list[str], max_tokens: int, reps: int) -> dict:
    """Aggregate tokens/s of ``c`` concurrent ``acall`` clients, for each ``c``."""
    gen = continuous(generate.text(model))

    async def clients(c):
        states = await asyncio.gather(*[gen.acall(p, max_tokens=max_tokens, logprobs=0) for p in texts[:c]])
        return sum(map(generated, states))

    gen(texts[0], max_tokens=4)  # warm up
    out = {}
    for c in CLIENTS:
        runs = []
        for _ in range(reps):
            t = time.perf_counter()
            tokens = asyncio.run(clients(c))
            runs.append(tokens / (time.perf_counter() - t))
        out[c] = round(median(runs), 1)
    return out


def hf_batch(hf, tok, texts: list[str], max_tokens: int, reps: int) -> float:
    """Tokens/s of transformers' ``generate_batch`` on the same prompts (greedy, same max tokens)."""
    from transformers import GenerationConfig

    ids = [tok(t)["input_ids"] for t in texts]
    config = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=tok.eos_token_id,
                              pad_token_id=tok.pad_token_id or tok.eos_token_id)
    runs = []
    for _ in range(reps):
        t = time.perf_counter()
        result = hf.generate_batch(ids, generation_config=config, progress_bar=False)
        tokens = sum(len(r.generated_tokens) for r in result.values())
        runs.append(tokens / (time.perf_counter() - t))
    return round(median(runs), 1)


def latency(model, texts: list[str], max_tokens: int) -> dict:
    """p50/p99 time to first token and time per output token (ms) at ``len(texts)`` streaming clients."""
    gen = continuous(generate.text(model))
    first, per_token = [], []

    async def client(p):
        start = time.perf_counter()
        stream, seen, t0 = gen.astream(p, max_tokens=max_tokens), 0, None
        async for piece in stream:
            if piece and t0 is None:
                t0 = time.perf_counter()
                first.append(t0 - start)
            seen += 1
        if t0 is not None and seen > 1:
            per_token.append((time.perf_counter() - t0) / (seen - 1))

    async def main():
        await asyncio.gather(*map(client, texts))

    asyncio.run(main())

    def pct(xs, q):
        return round(1000 * statistics.quantiles(xs, n=100, method="inclusive")[q - 1], 1) if len(xs) > 1 else None

    return {"ttft_ms": {"p50": pct(first, 50), "p99": pct(first, 99)},
            "tpot_ms": {"p50": pct(per_token, 50), "p99": pct(per_token, 99)}}


def resent_chat(hf, tok, turns: int, max_tokens: int, reps: int) -> dict:
    """Prompt tokens forwarded and seconds over a chat whose every turn re-sends the history."""
    template = tok.chat_template or ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}"
                                     "{% endfor %}{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}")
    tok.chat_template = template
    out = {}
    for name, size in (("cache_on", "1GB"), ("cache_off", None)):
        model = models.transformers(hf, tok, prefix_cache=size)
        gen = continuous(generate.text(model))
        seconds = []
        for _ in range(reps):
            if model.prefix_cache is not None:
                model.prefix_cache.clear()
            messages, prefilled, ideal, seen = [], 0, 0, []
            t = time.perf_counter()
            for turn in range(turns):
                messages.append({"role": "user", "content": f"Question {turn}: tell me about {TOPICS[turn]}."})
                prompt = chat.prompt(model, messages)
                ids = tok(prompt)["input_ids"]
                before = model.stats.tokens_forwarded
                state = gen(prompt, max_tokens=max_tokens)
                decoded = len(state.token_ids[0]) - int((state.attention_mask[0] == 0).sum()) - len(ids)
                prefilled += model.stats.tokens_forwarded - before - max(decoded - 1, 0)
                common = max((next((i for i, (a, b) in enumerate(zip(ids, s)) if a != b), min(len(ids), len(s)))
                              for s in seen), default=0)
                ideal += len(ids) - min(common, len(ids) - 1)
                seen.append(state._rows.real_ids(0)[: int(state._rows.cached_lengths()[0])])
                messages.append({"role": "assistant", "content": state.value})
            seconds.append(time.perf_counter() - t)
        out[name] = {"prompt_tokens_forwarded": prefilled, "ideal": ideal, "seconds": round(median(seconds), 2)}
    return out


def bench(name: str, args) -> dict:
    hf, tok = load(name, args.quick)
    max_tokens = 16 if args.quick else 64
    texts = prompts(tok, max(CLIENTS))
    model = models.transformers(hf, tok)
    library = concurrency(model, texts, max_tokens, args.reps)
    result = {
        "tokens_per_s": library,
        "ratio_to_one": {c: round(v / library[1], 2) for c, v in library.items()},
        "hf_generate_batch_tokens_per_s": hf_batch(hf, tok, texts, max_tokens, args.reps),
        "latency_16": latency(model, texts, max_tokens),
        "chat": resent_chat(hf, tok, 3 if args.quick else 8, 8 if args.quick else 32, args.reps),
    }
    result["library_over_generate_batch_16"] = round(library[16] / result["hf_generate_batch_tokens_per_s"], 2)
    return result


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    names = ["small"] if args.quick else (["mid", "smollm2"] if args.model == "both" else [args.model])
    results = {name: bench(name, args) for name in names}
    table = [("model", "clients", "tokens/s", "x one client")]
    for name, r in results.items():
        for c in CLIENTS:
            table.append((name, c, r["tokens_per_s"][c], r["ratio_to_one"][c]))
        table.append((name, "generate_batch 16", r["hf_generate_batch_tokens_per_s"], ""))
    emit("serve", table, {"bench": "serve", "threads": args.threads, "library": results}, args.save)


if __name__ == "__main__":
    main()
