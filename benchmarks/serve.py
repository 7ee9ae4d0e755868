"""Many callers, one model: concurrent clients, chats that re-send their history, latency.

    python benchmarks/serve.py [--quick] [--save] [--reps N] [--threads T] [--model mid|smollm2|both]

Run it alone: its figures are throughput and latency. Every competitor is greedy, fp32,
on the same prompts, max tokens and torch threads. Through the library (coroutines on one
model; concurrent calls share forward passes):

- ``library_concurrency``: 1, 4, 8 and 16 concurrent ``acall`` clients, each a 64-token
  completion of a different prompt; aggregate generated tokens/s and the ratio to one
  client; the same prompts as one batched call (the most that merged calls can reach:
  one decoding loop, no rendezvous) and through transformers' ``generate_batch`` (its
  continuous batching, in the same process).
- ``library_chat``: eight turns whose prompt re-sends the whole history, prefix cache on
  and off: prompt tokens forwarded against the ideal (what no earlier turn's state holds).
- ``library_latency``: 16 streaming clients (``astream``); p50/p99 time to first token
  and time per output token.

Through the OpenAI-compatible server (``python -m continuous.serve`` in a subprocess,
driven by the official ``openai`` client):

- ``server_concurrency``: as above, through HTTP.
- ``chat_resent_history``: eight chat turns re-sending the history; per turn the prompt
  tokens, those the prefix cache saved (``usage.prompt_tokens_details.cached_tokens``)
  and the new ones (the ideal prefill); seconds with the cache on against off.
- ``server_latency``: 16 streaming clients; p50 and p99 TTFT and TPOT.

``--quick`` runs the "small" model with fewer clients and tokens (a smoke run). The last
line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch
from common import MODELS, emit, median, random_text
from support.serving import NAME, TEMPLATE, start, stop

from continuous import chat, continuous, generate, models


def concurrently(n: int, work) -> tuple[list, float]:
    """``work(i)`` for ``i < n`` in ``n`` threads started together: the results and the wall seconds."""
    results: list = [None] * n
    barrier = threading.Barrier(n + 1)

    def run(i):
        barrier.wait()
        results[i] = work(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    barrier.wait()
    began = time.perf_counter()
    for t in threads:
        t.join()
    return results, time.perf_counter() - began


def generated(state) -> int:
    return sum(len(lp) for lp in state.logprobs) if state.logprobs is not None else 0


def library_concurrency(model, texts: list[str], clients, max_tokens: int, reps: int) -> tuple[dict, dict, dict]:
    """Aggregate tokens/s of ``c`` concurrent ``acall`` clients, and of one call holding the same
    ``c`` prompts as a batch (what concurrent calls reach at best: one decoding loop, one forward
    per step), for each ``c``; and their ratio. The two alternate, rep by rep, so that a drift
    of the machine's speed falls on both (the ratio is the median of each rep's)."""
    gen = continuous(generate.text(model))

    async def together(c):
        states = await asyncio.gather(*[gen.acall(p, max_tokens=max_tokens, logprobs=0) for p in texts[:c]])
        return sum(map(generated, states))

    def rate(run) -> float:
        t = time.perf_counter()
        tokens = run()
        return tokens / (time.perf_counter() - t)

    gen(texts[0], max_tokens=4)  # warm up
    rates, one_call, ratios = {}, {}, {}
    for c in clients:
        runs = [(rate(lambda: asyncio.run(together(c))),
                 rate(lambda: generated(gen(texts[:c], max_tokens=max_tokens, logprobs=0)))) for _ in range(reps)]
        rates[str(c)] = round(median(r for r, _ in runs), 1)
        one_call[str(c)] = round(median(o for _, o in runs), 1)
        ratios[str(c)] = round(median(r / o for r, o in runs), 2)
    return rates, one_call, ratios


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


def library_latency(model, texts: list[str], max_tokens: int) -> dict:
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


def library_chat(hf, tok, questions: list[str], max_tokens: int, reps: int) -> dict:
    """Prompt tokens forwarded and seconds over a chat whose every turn re-sends the history."""
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
            for question in questions:
                messages.append({"role": "user", "content": question})
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


def server_concurrency(server, prompts: list[str], clients=(1, 4, 8, 16), max_tokens: int = 64) -> dict:
    """Aggregate generated tokens/s of ``c`` clients at once, each completing its own prompt."""
    out = {}
    for c in clients:
        def one(i):
            answer = server.client().completions.create(model=NAME, prompt=prompts[i], max_tokens=max_tokens,
                                                        temperature=0)
            return answer.usage.completion_tokens

        tokens, seconds = concurrently(c, one)
        out[str(c)] = {"tokens": sum(tokens), "seconds": round(seconds, 3),
                       "tokens_per_s": round(sum(tokens) / seconds, 2)}
    base = out[str(clients[0])]["tokens_per_s"]
    for row in out.values():
        row["vs_one"] = round(row["tokens_per_s"] / base, 2)
    return out


def chat_resent_history(server, system: str, questions: list[str], max_tokens: int = 32) -> dict:
    """Chat turns re-sending the whole history: tokens per turn (prompt, cached, new) and seconds."""
    client = server.client()
    messages = [{"role": "system", "content": system}]
    turns, last, began = [], None, time.perf_counter()
    for question in questions:
        messages.append({"role": "user", "content": question})
        before = server.health()["stats"]["tokens_forwarded"]
        answer = client.chat.completions.create(model=NAME, messages=messages, max_tokens=max_tokens, temperature=0)
        usage = answer.usage
        new = usage.prompt_tokens - (last.prompt_tokens + last.completion_tokens if last else 0)
        turns.append({"prompt": usage.prompt_tokens, "cached": usage.prompt_tokens_details.cached_tokens,
                      "new": new, "generated": usage.completion_tokens,
                      "forwarded": server.health()["stats"]["tokens_forwarded"] - before})
        messages.append({"role": "assistant", "content": answer.choices[0].message.content})
        last = usage
    seconds = time.perf_counter() - began
    prefilled = [t["prompt"] - t["cached"] for t in turns]
    return {"turns": turns, "seconds": round(seconds, 3), "prefilled": sum(prefilled),
            "ideal": sum(t["new"] for t in turns),
            "prefilled_is_ideal": all(p == t["new"] for p, t in zip(prefilled, turns))}


def server_latency(server, prompts: list[str], clients: int = 16, max_tokens: int = 64) -> dict:
    """p50 and p99 of the time to first token and the time per output token, ``clients`` streams at once."""
    def one(i):
        began, first, end = time.perf_counter(), None, None
        stream = server.client().completions.create(model=NAME, prompt=prompts[i], max_tokens=max_tokens,
                                                    temperature=0, stream=True,
                                                    stream_options={"include_usage": True})
        tokens = 0
        for chunk in stream:
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            if any(c.text for c in chunk.choices):
                first = first or time.perf_counter()
                end = time.perf_counter()
        return (first - began if first else None), ((end - first) / (tokens - 1) if first and tokens > 1 else None)

    results, _ = concurrently(clients, one)
    ttft = [r[0] for r in results if r[0] is not None]
    tpot = [r[1] for r in results if r[1] is not None]

    def ms(xs, q):
        return round(float(np.percentile(xs, q)) * 1000, 2) if xs else None

    return {"clients": clients, "ttft_ms": {"p50": ms(ttft, 50), "p99": ms(ttft, 99)},
            "tpot_ms": {"p50": ms(tpot, 50), "p99": ms(tpot, 99)}}


@contextlib.contextmanager
def serving(model_dir: Path, *args: str):
    """A server of ``model_dir`` for the block, warmed up; stopped by its pid after."""
    with tempfile.TemporaryDirectory() as tmp:
        server = start(model_dir, Path(tmp) / "server.log", *args)
        try:
            # The first calls pay one-time costs (allocations, kernels); no measurement should.
            server.client().completions.create(model=NAME, prompt="warm up", max_tokens=4)
            server.client().chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=4)
            yield server
        finally:
            stop(server.pid)


def model_dir(name: str, quick: bool) -> tuple[Path, list[str]]:
    """The model's folder, and the server arguments it needs (a chat template for the random models)."""
    if name == "smollm2":
        from support.real import smollm2

        return smollm2(), []
    from support.models import build_model_dir

    size = "small" if quick else "mid"
    path = build_model_dir(MODELS / size, size=size, seed=0)
    template = MODELS / "chat_template.jinja"
    template.write_text(TEMPLATE)
    return path, ["--chat-template", str(template)]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the small model, fewer clients and tokens")
    parser.add_argument("--save", action="store_true", help="write benchmarks/results/serve.json")
    parser.add_argument("--reps", type=int, default=2, help="repetitions of the library's measurements (median)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads, here and in the server")
    parser.add_argument("--model", choices=("mid", "smollm2", "both"), default="both", help="mid: random weights")
    return parser.parse_args()


def library(path: Path, prompts, questions, clients, tokens: int, reps: int) -> dict:
    """The library's figures on the model at ``path`` (its chat template set for random models)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = tok.chat_template or TEMPLATE
    model = models.transformers(hf, tok)
    rates, one_call, vs_one_call = library_concurrency(model, prompts, clients, tokens, reps)
    batch = hf_batch(hf, tok, prompts[: max(clients)], tokens, reps)
    return {"tokens_per_s": rates, "vs_one": {c: round(v / rates[str(clients[0])], 2) for c, v in rates.items()},
            "one_call_tokens_per_s": one_call, "vs_one_call": vs_one_call,
            "generate_batch_tokens_per_s": batch, "vs_generate_batch": round(rates[str(max(clients))] / batch, 2),
            "latency": library_latency(model, prompts[: max(clients)], tokens),
            "chat": library_chat(hf, tok, questions, tokens // 2, reps)}


def server(path: Path, extra: list[str], prompts, system, questions, clients, tokens: int) -> dict:
    with serving(path, *extra, "--max-queue", "64") as running:
        concurrency = server_concurrency(running, prompts, clients, tokens)
        latency = server_latency(running, prompts, max(clients), tokens)
        cached = chat_resent_history(running, system, questions, tokens // 2)
    with serving(path, *extra, "--prefix-cache", "0") as running:
        uncached = chat_resent_history(running, system, questions, tokens // 2)
    return {"concurrency": concurrency, "latency": latency,
            "chat": {"cache_on": cached, "cache_off": uncached,
                     "speedup": round(uncached["seconds"] / cached["seconds"], 3)}}


def main():
    from transformers import AutoTokenizer

    args = parse_args()
    torch.set_num_threads(args.threads)
    names = ["small"] if args.quick else (["mid", "smollm2"] if args.model == "both" else [args.model])
    clients, tokens, turns = ((1, 2, 4), 8, 3) if args.quick else ((1, 4, 8, 16), 64, 8)
    results, table = {}, [("model", "measurement", "figure")]
    for name in names:
        path, extra = model_dir(name, args.quick)
        extra += ["--threads", str(args.threads)]
        tok = AutoTokenizer.from_pretrained(path)
        prompts = [random_text(tok, 32, seed=100 + i) for i in range(max(clients))]
        system = random_text(tok, 64 if args.quick else 256, seed=1)
        questions = [random_text(tok, 24, seed=10 + i) for i in range(turns)]
        lib = library(path, prompts, questions, clients, tokens, args.reps)
        srv = server(path, extra, prompts, system, questions, clients, tokens)
        results[name] = {"library": lib, "server": srv}
        table += [(name, f"library, {c} clients", f"{v} tok/s ({lib['vs_one'][c]}x one client, "
                   f"{lib['vs_one_call'][c]}x one call of {c} prompts: {lib['one_call_tokens_per_s'][c]})")
                  for c, v in lib["tokens_per_s"].items()]
        table += [(name, f"generate_batch, {max(clients)} prompts", f"{lib['generate_batch_tokens_per_s']} tok/s"),
                  (name, "library chat prefilled / ideal, cache on",
                   f"{lib['chat']['cache_on']['prompt_tokens_forwarded']} / {lib['chat']['cache_on']['ideal']}"),
                  (name, "library chat s, cache on / off",
                   f"{lib['chat']['cache_on']['seconds']} / {lib['chat']['cache_off']['seconds']}")]
        table += [(name, f"server, {c} clients", f"{r['tokens_per_s']} tok/s ({r['vs_one']}x)")
                  for c, r in srv["concurrency"].items()]
        chat_on = srv["chat"]["cache_on"]
        table += [(name, "server chat prefilled / ideal", f"{chat_on['prefilled']} / {chat_on['ideal']}"),
                  (name, "server chat s, cache on / off", f"{chat_on['seconds']} / {srv['chat']['cache_off']['seconds']}"),
                  (name, "server ttft p50 / p99 ms", f"{srv['latency']['ttft_ms']['p50']} / {srv['latency']['ttft_ms']['p99']}"),
                  (name, "server tpot p50 / p99 ms", f"{srv['latency']['tpot_ms']['p50']} / {srv['latency']['tpot_ms']['p99']}")]
    emit("serve", table, {"bench": "serve", "threads": args.threads, "models": results}, args.save)


if __name__ == "__main__":
    main()
