"""Many callers, one model: concurrent clients, chats that re-send their history, latency.

    python benchmarks/serve.py [--quick] [--save] [--model mid|smollm2]

Each measurement is a function; these run through the OpenAI-compatible server
(``python -m continuous.serve`` in a subprocess, driven by the official ``openai``
client), all greedy:

- ``server_concurrency``: 1, 4, 8 and 16 concurrent clients, each a 64-token completion
  of a different prompt; aggregate generated tokens/s and the ratio to one client.
- ``chat_resent_history``: eight chat turns, each re-sending the whole history as
  OpenAI-style clients do; per turn the prompt tokens, those the prefix cache saved
  (``usage.prompt_tokens_details.cached_tokens``) and the new tokens (the ideal prefill:
  this turn's prompt less the last turn's prompt and answer). Seconds with the prefix
  cache on, against a server with it off.
- ``server_latency``: 16 streaming clients; p50 and p99 time to first token and time per
  output token.

``--quick`` runs the "small" model with fewer clients and tokens (a smoke run). The last
line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from common import MODELS, emit, random_text
from support.serving import NAME, TEMPLATE, start, stop


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
    parser.add_argument("--model", choices=("mid", "smollm2"), default="mid", help="mid: random weights")
    return parser.parse_args()


def main():
    from transformers import AutoTokenizer

    args = parse_args()
    path, extra = model_dir(args.model, args.quick)
    tok = AutoTokenizer.from_pretrained(path)
    clients, tokens, turns = ((1, 2, 4), 8, 3) if args.quick else ((1, 4, 8, 16), 64, 8)
    prompts = [random_text(tok, 32, seed=100 + i) for i in range(max(clients))]
    system = random_text(tok, 64 if args.quick else 256, seed=1)
    questions = [random_text(tok, 24, seed=10 + i) for i in range(turns)]
    with serving(path, *extra, "--max-queue", "64") as server:
        concurrency = server_concurrency(server, prompts, clients, tokens)
        latency = server_latency(server, prompts, max(clients), tokens)
        cached = chat_resent_history(server, system, questions, tokens // 2)
    with serving(path, *extra, "--prefix-cache", "0") as server:
        uncached = chat_resent_history(server, system, questions, tokens // 2)
    table = [("measurement", "figure")]
    table += [(f"server, {c} clients", f"{r['tokens_per_s']} tok/s ({r['vs_one']}x)") for c, r in concurrency.items()]
    table += [("chat, prefilled / ideal", f"{cached['prefilled']} / {cached['ideal']}"),
              ("chat seconds, cache on / off", f"{cached['seconds']} / {uncached['seconds']}"),
              ("ttft p50 / p99 ms", f"{latency['ttft_ms']['p50']} / {latency['ttft_ms']['p99']}"),
              ("tpot p50 / p99 ms", f"{latency['tpot_ms']['p50']} / {latency['tpot_ms']['p99']}")]
    result = {"bench": "serve", "model": args.model if not args.quick else "small",
              "server": {"concurrency": concurrency, "latency": latency,
                         "chat": {"cache_on": cached, "cache_off": uncached,
                                  "speedup": round(uncached["seconds"] / cached["seconds"], 3)}}}
    emit("serve", table, result, args.save)


if __name__ == "__main__":
    main()
