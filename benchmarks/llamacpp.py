"""llama.cpp's own server against the library on ``models.llamacpp``: the same GGUF, threads, greedy decoding.

    python benchmarks/llamacpp.py [--quick] [--save] [--reps N] [--torch-threads N]

SmolLM2-135M-Instruct, F32 (converted by llama.cpp's ``convert_hf_to_gguf.py``), a KV cache
of F32 on both sides (``-ctk f32 -ctv f32`` / ``type_k="f32", type_v="f32"``), ``-c 4096`` /
``n_ctx=4096``. The server is ``llama-server`` built from the same llama.cpp sources as
llama-cpp-python (``python tests/support/llamacpp.py server``), started on 127.0.0.1 and
stopped by its pid; it is greedy (``temperature 0``, ``top_k 1``) with its prompt reuse
(``cache_prompt``) on, its RAM prompt cache off (``--cache-ram 0``: no rep reuses an
earlier rep's prompt). Prompts reach it as our tokenizer's ids, and reps are interleaved
(which side goes first alternates). Figures:

- ``decode``: ms per generated token at 1 and 2 threads (``-np 1``), 128 tokens after a
  fixed chat prompt; the server's ``timings.predicted_per_token_ms``, ours the time of a
  call continuing the prefilled prompt, over its tokens (both: N tokens, N - 1 decodes,
  prefill excluded);
- ``chat``: 6 user turns in SmolLM2's template, answers of at most 48 tokens ending at
  end of turn, 2 threads: seconds for the chat; ours a ``chat.Conversation``, the server
  ``/v1/chat/completions`` re-sent the history (its slot erased before each rep); per
  turn the prompt tokens the server prefilled (``timings.prompt_n``) and ours (from
  ``model.stats``: tokens forwarded less one per decode step);
- ``json``: the 10 customer messages of ``real.py`` into its ``Order``, 2 threads,
  seconds per document (each call from its chat prompt); the server with its
  ``json_schema`` field (its grammar), ours ``generate.json``; outputs compared;
- ``concurrent``: 8 clients at once (``-np 8`` / 8 ``acall`` on one model), 2 threads, each
  a 64-token greedy completion of its own 32-token prompt (new prompts each rep);
  aggregate generated tokens/s;
- ``memory``: peak RSS (VmHWM) of the serving process after the concurrent workload:
  the server's pid, and a subprocess of ours that only loads the model and serves it;
- ``q4_1``: ``decode`` on SmolLM2's Q4_1 GGUF, and the serving processes' peak RSS.

Our process also runs torch, on the logits between llama.cpp's decodes (constraint masks,
sampling), on torch's default threads unless ``--torch-threads`` says otherwise.

Greedy outputs are compared token by token (``same``). ``--quick`` is a smoke run (tiny
sizes; without llama-server only our side runs, and without llama-cpp-python nothing).
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import importlib.util
import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import torch
from common import RESULTS, emit, median, random_text, timed
from real import QUESTIONS, Order, orders
from serve import concurrently
from support.serving import stop

from continuous import chat, continuous, generate, models

N_CTX = 4096
STORY = "Write a long story about a lighthouse keeper who finds a message in a bottle."
#: ``threads``: of the decode rows; ``shared``: of the other workloads (one thread in a smoke run).
SIZES = {"full": {"threads": (1, 2), "shared": 2, "decode": 128, "turns": 6, "answer": 48, "documents": 10,
                  "clients": 8, "completion": 64},
         "quick": {"threads": (1,), "shared": 1, "decode": 8, "turns": 2, "answer": 8, "documents": 2,
                   "clients": 8, "completion": 8}}


def peak_rss_mb(pid: int | str = "self") -> float:
    """A process's peak resident memory (VmHWM), in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return round(int(line.split()[1]) / 1024, 1)
    raise RuntimeError(f"no VmHWM in /proc/{pid}/status")


class LlamaServer:
    """``llama-server`` on a free port of 127.0.0.1 for a ``with`` block, stopped by its pid after."""

    def __init__(self, binary: Path, gguf: Path, threads: int, slots: int):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.command = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port),
                        "-t", str(threads), "-tb", str(threads), "-c", str(N_CTX), "-np", str(slots),
                        "-ctk", "f32", "-ctv", "f32", "--cache-ram", "0", "--no-webui",
                        "--slot-save-path", tempfile.gettempdir()]  # which enables erasing a slot
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "LlamaServer":
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log")
        self.proc = subprocess.Popen(self.command, stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}: {self._tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5):
                    return self
            except OSError:  # refused while it starts, 503 while it loads the model
                time.sleep(0.2)
        self.__exit__()
        raise RuntimeError(f"llama-server did not answer in 300 s: {self._tail()}")

    def __exit__(self, *exc) -> None:
        stop(self.proc.pid)
        self.log.close()

    def _tail(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()[-3000:]

    def post(self, path: str, body: dict) -> dict:
        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=600) as answer:
                return json.loads(answer.read())
        except urllib.error.HTTPError as exc:
            raise RuntimeError(f"llama-server answered {exc.code} to {path}: {exc.read()[:500]!r}") from exc

    def complete(self, ids: list[int], n: int, **fields) -> dict:
        """A greedy ``/completion`` of ``n`` tokens after the prompt ``ids``, its token ids returned."""
        body = {"prompt": ids, "n_predict": n, "temperature": 0, "top_k": 1, "return_tokens": True, **fields}
        return self.post("/completion", body)

    def peak_rss_mb(self) -> float:
        return peak_rss_mb(self.proc.pid)


def load(gguf: Path, tokenizer, threads: int):
    """Our model of ``gguf``: the same context size and KV type as the server's."""
    return models.llamacpp(gguf, n_ctx=N_CTX, n_threads=threads, tokenizer=tokenizer, type_k="f32", type_v="f32")


def generated(state, n_prompt: int) -> list[int]:
    """The token ids a one-row state holds after its prompt (an end of turn included, as the server counts)."""
    return state.token_ids[0][state.attention_mask[0].bool()].tolist()[n_prompt:]


def strip(ids: list[int], stops) -> list[int]:
    """``ids`` without a final end of turn: what the two sides' outputs are compared on."""
    return ids[:-1] if ids and ids[-1] in stops else ids


def interleaved(reps: int, runs: dict) -> dict:
    """Each run once per rep, the order alternating between reps: ``{name: [result of each rep]}``."""
    out = {name: [] for name in runs}
    for rep in range(reps):
        for name in (list(runs) if rep % 2 == 0 else list(runs)[::-1]):
            out[name].append(runs[name](rep))
    return out


def decode(model, server, n: int, reps: int) -> dict:
    """ms per generated token after a prefilled chat prompt; the tokens of both sides compared."""
    text = chat.prompt(model, [{"role": "user", "content": STORY}])
    ids, stops = model.tokenizer(text)["input_ids"], set(model.eos_token_ids)
    gen = continuous(generate.text(model))
    warm_up(gen, text, server, ids)

    def ours(rep):
        base = gen(text, max_tokens=0)  # the prompt prefilled: only the decode is timed
        state, seconds = timed(lambda: gen(base, max_tokens=n))
        tokens = generated(state, len(ids))
        return {"ms": 1e3 * seconds / len(tokens), "tokens": strip(tokens, stops)}

    def theirs(rep):
        answer = server.complete(ids, n)
        return {"ms": answer["timings"]["predicted_per_token_ms"], "tokens": strip(answer["tokens"], stops)}

    return summary(interleaved(reps, {"ours": ours, **({"server": theirs} if server else {})}), "ms")


def warm_up(gen, text: str, server, ids: list[int], **fields) -> None:
    """A short call on each side first: what runs once (allocations, a grammar's build) is not measured."""
    gen(text, max_tokens=4)
    if server:
        server.complete(ids, 4, **fields)


def summary(runs: dict, key: str) -> dict:
    """The median of ``key`` per side, its ratio to the server's, and whether the outputs were equal."""
    out = {name: round(median([r[key] for r in results]), 3) for name, results in runs.items()}
    if "server" in runs:
        out["ratio"] = round(out["ours"] / out["server"], 3)
        out["same"] = all(a["tokens"] == b["tokens"] for a, b in zip(runs["ours"], runs["server"]))
    out["tokens"] = len(runs["ours"][0]["tokens"])
    return out


def chat_turns(model, server, turns: int, answer: int, reps: int) -> dict:
    """Seconds for a chat of ``turns`` questions; prompt tokens prefilled per turn on both sides."""
    questions = QUESTIONS[:turns]
    gen, stats, tok = continuous(generate.text(model)), model.stats, model.tokenizer
    first = chat.prompt(model, [{"role": "user", "content": questions[0]}])
    warm_up(gen, first, server, tok(first)["input_ids"])

    def ours(rep):
        conv, prefilled, began = chat.Conversation(model), [], time.perf_counter()
        for question in questions:
            tokens, calls = stats.tokens_forwarded, stats.forward_calls
            conv.add("user", question).reply(gen, max_tokens=answer)
            # One call forwards its prompt's new tokens (under one prefill chunk), then one token a step.
            prefilled.append((stats.tokens_forwarded - tokens) - (stats.forward_calls - calls - 1))
        seconds, messages = time.perf_counter() - began, conv.messages
        prompts = [len(tok(chat.prompt(model, messages[:k]))["input_ids"]) for k in range(1, len(messages), 2)]
        ids = [tok(m["content"], add_special_tokens=False)["input_ids"] for m in messages[1::2]]
        return {"seconds": seconds, "prefilled": prefilled, "prompts": prompts, "tokens": ids}

    def theirs(rep):
        server.post("/slots/0?action=erase", {})  # each rep starts cold, as ours does
        messages, replies, began = [], [], time.perf_counter()
        for question in questions:
            messages.append({"role": "user", "content": question})
            replies.append(server.post("/v1/chat/completions", {"messages": messages, "max_tokens": answer,
                                                                "temperature": 0, "top_k": 1}))
            messages.append({"role": "assistant", "content": replies[-1]["choices"][0]["message"]["content"]})
        seconds = time.perf_counter() - began
        return {"seconds": seconds, "prefilled": [r["timings"]["prompt_n"] for r in replies],
                "prompts": [r["usage"]["prompt_tokens"] for r in replies],
                "tokens": [tok(m["content"], add_special_tokens=False)["input_ids"] for m in messages[1::2]]}

    runs = interleaved(reps, {"ours": ours, **({"server": theirs} if server else {})})
    out = summary(runs, "seconds")
    out["turns"] = out.pop("tokens")
    out["prefilled_per_turn"] = {name: results[0]["prefilled"] for name, results in runs.items()}
    out["prompt_tokens_per_turn"] = {name: results[0]["prompts"] for name, results in runs.items()}
    out["answers"] = [tok.decode(ids) for ids in runs["ours"][0]["tokens"]]
    return out


def extraction(model, server, documents: int, reps: int) -> dict:
    """Seconds per document extracting an ``Order`` from each message; the JSON of both sides compared."""
    tok = model.tokenizer
    prompts = [chat.prompt(model, [{"role": "user", "content": "Extract the order as JSON with fields customer, "
                                    f"item, quantity. Message: '{message}'"}]) for message, _ in orders(False)]
    prompts = prompts[:documents]
    ids = [tok(p)["input_ids"] for p in prompts]
    gen, schema = continuous(generate.json(model, Order)), Order.model_json_schema()
    warm_up(gen, prompts[0], server, ids[0], json_schema=schema)

    def ours(rep):
        states, seconds = timed(lambda: [gen(p, max_tokens=96) for p in prompts])
        texts = [str(s)[len(p):] for s, p in zip(states, prompts)]
        return {"seconds": seconds / len(prompts), "tokens": [parsed(t) for t in texts], "texts": texts}

    def theirs(rep):
        server.post("/slots/0?action=erase", {})  # the first document's prompt is not the warm-up's
        answers, seconds = timed(lambda: [server.complete(i, 96, json_schema=schema) for i in ids])
        texts = [a["content"] for a in answers]
        return {"seconds": seconds / len(prompts), "tokens": [parsed(t) for t in texts], "texts": texts,
                "prefilled": [a["timings"]["prompt_n"] for a in answers]}

    runs = interleaved(reps, {"ours": ours, **({"server": theirs} if server else {})})
    out = summary(runs, "seconds")
    out["documents"] = out.pop("tokens")
    out["same_values"] = out.pop("same", None)  # ``tokens`` here holds each document's parsed JSON
    if server:
        out["same_texts"] = runs["ours"][0]["texts"] == runs["server"][0]["texts"]
        out["server_prefilled"] = runs["server"][0]["prefilled"]
    out["outputs"] = runs["ours"][0]["texts"]
    return out


def parsed(text: str):
    """The JSON value of an output, or ``None`` where it is not JSON (cut by the token limit)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def client_prompts(tokenizer, clients: int, rep: int) -> list[str]:
    """``clients`` different 32-token prompts, new for each rep (no side reuses a prompt's cache)."""
    return [random_text(tokenizer, 32, seed=1000 * (rep + 1) + i) for i in range(clients)]


def ours_concurrent(model, texts: list[str], n: int) -> tuple[list[list[int]], float]:
    """``len(texts)`` concurrent ``acall`` clients on one model: the generated ids of each, and the seconds."""
    gen, tok = continuous(generate.text(model)), model.tokenizer

    async def together():
        return await asyncio.gather(*[gen.acall(t, max_tokens=n) for t in texts])

    states, seconds = timed(lambda: asyncio.run(together()))
    ids = [generated(s, len(tok(t)["input_ids"])) for s, t in zip(states, texts)]
    return ids, seconds


def concurrent(model, server, clients: int, n: int, reps: int) -> dict:
    """Aggregate tokens/s of ``clients`` greedy completions at once, each of its own prompt."""
    tok, stops = model.tokenizer, set(model.eos_token_ids)

    def ours(rep):
        ids, seconds = ours_concurrent(model, client_prompts(tok, clients, rep), n)
        return {"tokens_per_s": sum(map(len, ids)) / seconds, "tokens": [strip(i, stops) for i in ids]}

    def theirs(rep):
        prompts = [tok(t)["input_ids"] for t in client_prompts(tok, clients, rep)]
        answers, seconds = concurrently(clients, lambda i: server.complete(prompts[i], n))
        ids = [a["tokens"] for a in answers]
        return {"tokens_per_s": sum(map(len, ids)) / seconds, "tokens": [strip(i, stops) for i in ids]}

    ours_concurrent(model, client_prompts(tok, 2, -1), 4)  # warm up: the first joint decodes
    if server:
        server.complete(tok(client_prompts(tok, 1, -1)[0])["input_ids"], 4)
    out = summary(interleaved(reps, {"ours": ours, **({"server": theirs} if server else {})}), "tokens_per_s")
    out["clients"] = out.pop("tokens")
    return out


def ours_peak_rss(gguf: Path, threads: int, clients: int, n: int) -> float:
    """Peak RSS of a fresh process that loads our model and serves the concurrent workload once."""
    proc = subprocess.run([sys.executable, __file__, "--serve-once", str(gguf), "--threads", str(threads),
                           "--clients", str(clients), "--tokens", str(n),
                           "--torch-threads", str(torch.get_num_threads())],
                          cwd=Path(__file__).parent, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"the memory subprocess failed: {proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])["peak_rss_mb"]


def serve_once(args) -> None:
    """The memory subprocess: load the model, serve the concurrent workload once, print the peak RSS."""
    from support.real import smollm2
    from transformers import AutoTokenizer

    model = load(Path(args.serve_once), AutoTokenizer.from_pretrained(smollm2()), args.threads)
    ours_concurrent(model, client_prompts(model.tokenizer, args.clients, 0), args.tokens)
    print(json.dumps({"peak_rss_mb": peak_rss_mb()}))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    parser.add_argument("--save", action="store_true", help="write benchmarks/results/llamacpp.json")
    parser.add_argument("--reps", type=int, default=3, help="interleaved repetitions of each side (median)")
    parser.add_argument("--torch-threads", type=int, help="torch's threads in our process (default: torch's "
                        "own), which run the logits' processing while llama.cpp runs the model")
    parser.add_argument("--only-concurrent", action="store_true",
                        help="only the concurrent clients on the F32 GGUF (with --save: that figure of the file)")
    parser.add_argument("--serve-once", metavar="GGUF", help=argparse.SUPPRESS)  # the memory subprocess
    parser.add_argument("--threads", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--clients", type=int, default=8, help=argparse.SUPPRESS)
    parser.add_argument("--tokens", type=int, default=64, help=argparse.SUPPRESS)
    return parser.parse_args()


def installed(quick: bool):
    """llama-server's path, or ``None`` where a quick run goes on without it; exits where nothing can run."""
    if importlib.util.find_spec("llama_cpp") is None:
        if not quick:
            sys.exit("llama-cpp-python is not installed: pip install continuous[llamacpp] (or make llamacpp)")
        print("skipped: llama-cpp-python is not installed (pip install continuous[llamacpp])")
        emit("llamacpp", [("skipped",)], {"bench": "llamacpp", "skipped": "llama-cpp-python"}, False)
        sys.exit(0)
    from support.llamacpp import llama_server

    binary = llama_server()
    if binary is None:
        build = "llama-server is not built: python tests/support/llamacpp.py server"
        if not quick:
            sys.exit(build)
        print(f"server side skipped: {build}")
    return binary


def with_server(binary, gguf: Path, threads: int, slots: int):
    """A running server, or a block that yields ``None`` without one."""
    return LlamaServer(binary, gguf, threads, slots) if binary else contextlib.nullcontext()


def sections(binary, gguf: Path, tokenizer, size: dict, reps: int, every: bool) -> dict:
    """The figures of one GGUF file: decode at each thread count; with ``every``, the other workloads too."""
    out, shared = {"decode": {}}, size["shared"]
    for threads in size["threads"]:
        with with_server(binary, gguf, threads, 1) as server:
            model = load(gguf, tokenizer, threads)
            out["decode"][str(threads)] = decode(model, server, size["decode"], reps)
            if every and threads == shared:
                out["chat"] = chat_turns(model, server, size["turns"], size["answer"], reps)
                out["json"] = extraction(model, server, size["documents"], reps)
            del model
            gc.collect()
    with with_server(binary, gguf, shared, size["clients"]) as server:
        model = load(gguf, tokenizer, shared)
        if every:
            out["concurrent"] = concurrent(model, server, size["clients"], size["completion"], reps)
        else:  # only what the memory row measures
            concurrent(model, server, size["clients"], size["completion"], 1)
        out["memory_mb"] = {"ours": ours_peak_rss(gguf, shared, size["clients"], size["completion"]),
                            **({"server": server.peak_rss_mb()} if server else {})}
        del model
        gc.collect()
    return out


def table(f32: dict, q4: dict, shared: int) -> list[tuple]:
    """The printed table: each figure ours / the server's, the ratio, whether the outputs were equal."""
    def row(name, figure, unit, digits=1):
        theirs = figure.get("server")
        ratio = figure.get("ratio", round(figure["ours"] / theirs, 3) if theirs else "-")
        return (name, f"{figure['ours']:.{digits}f} {unit}", f"{theirs:.{digits}f} {unit}" if theirs else "-",
                ratio, figure.get("same", figure.get("same_values", "-")))

    threads = f"{shared} thread{'s' * (shared > 1)}"
    rows = [("workload", "ours", "llama-server", "ours / server", "same outputs")]
    rows += [row(f"F32 decode, {t} thread(s)", f, "ms/tok") for t, f in f32["decode"].items()]
    rows.append(row(f"F32 {f32['chat']['turns']}-turn chat, {threads}", f32["chat"], "s", 2))
    rows.append(row(f"F32 JSON extraction, {threads}", f32["json"], "s/doc", 3))
    rows.append(row(f"F32 {f32['concurrent']['clients']} clients, {threads}", f32["concurrent"], "tok/s"))
    rows.append(row("F32 peak RSS after the clients", f32["memory_mb"], "MB", 0))
    rows += [row(f"Q4_1 decode, {t} thread(s)", f, "ms/tok") for t, f in q4["decode"].items()]
    rows.append(row("Q4_1 peak RSS after the clients", q4["memory_mb"], "MB", 0))
    prefill = f32["chat"]["prefilled_per_turn"]
    rows.append(("chat prompt tokens prefilled per turn", str(prefill["ours"]), str(prefill.get("server", "-")),
                 "", ""))
    return rows


def only_concurrent(binary, gguf: Path, tokenizer, size: dict, args) -> None:
    """The ``concurrent`` figure alone; saved, it replaces that figure in the results file."""
    with with_server(binary, gguf, size["shared"], size["clients"]) as server:
        figure = concurrent(load(gguf, tokenizer, size["shared"]), server, size["clients"], size["completion"],
                            args.reps)
    path = RESULTS / "llamacpp.json"
    result = json.loads(path.read_text()) if args.save and path.exists() else {"bench": "llamacpp", "f32": {}}
    result["f32"]["concurrent"] = figure
    row = ("concurrent tokens/s", f"{figure['ours']:.1f}", f"{figure.get('server', '-')}", figure.get("ratio", "-"))
    emit("llamacpp", [("figure", "ours", "llama-server", "ratio"), row], result, args.save)


def main():
    args = parse_args()
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    if args.serve_once:
        return serve_once(args)
    binary = installed(args.quick)
    from support.llamacpp import f32_gguf
    from support.real import smollm2, smollm2_gguf
    from transformers import AutoTokenizer

    size = SIZES["quick" if args.quick else "full"]
    tokenizer = AutoTokenizer.from_pretrained(smollm2())
    if args.only_concurrent:
        return only_concurrent(binary, f32_gguf(smollm2()), tokenizer, size, args)
    f32 = sections(binary, f32_gguf(smollm2()), tokenizer, size, args.reps, every=True)
    q4 = sections(binary, smollm2_gguf(), tokenizer, size, args.reps, every=False)
    result = {"bench": "llamacpp", "model": "SmolLM2-135M-Instruct", "server": binary is not None,
              "kv_cache": "f32", "n_ctx": N_CTX, "torch_threads": torch.get_num_threads(), "sizes": size,
              "reps": args.reps, "f32": f32, "q4_1": q4}
    emit("llamacpp", table(f32, q4, size["shared"]), result, args.save)


if __name__ == "__main__":
    main()
