"""The torch CPU decode step: ours and its variants, HF ``generate``, bare GEMV sweeps, llama.cpp's server.

    python benchmarks/cpu.py [--quick] [--save] [--reps N] [--models smollm2 mid] [--threads 1 2]
                             [--tokens N] [--only NAME ...]

Run it alone: its figures are times. For each model and torch thread count, every
competitor greedy-decodes the same number of tokens after the same prompt; a token's
time excludes the prefill. Each figure comes from a fresh process (a "cell"): compiled
code bakes in its thread count and inductor settings, and the threading environment is
read once at start-up.

- :data:`VARIANTS` of ``continuous(generate.text(model))``: ``eager`` (fp32, the
  reference); ``compiled`` (``compile=True``: inductor on the decode step); ``frozen``
  (inductor with ``freezing``: weights folded in as constants and prepacked for the GEMM
  library); ``autotune`` (``compile="max-autotune"``); ``autotune_frozen`` (inductor's
  CPU GEMM templates only take frozen weights); ``bf16``, ``bf16_no_mkldnn`` (oneDNN
  off: ATen's own bf16 kernels) and ``bf16_frozen`` (bf16 weights). Each with whether its tokens equal ``eager``'s, the first run's seconds
  (compiling) and the process's peak memory.
- ``hf``: transformers' ``generate`` on the same prompt ids, timed from its first token.
- ``llamacpp_f32`` and ``llamacpp_q4_1``: llama.cpp's ``llama-server`` (when built), on
  an F32 GGUF of the same weights converted by llama.cpp's own script and, for SmolLM2,
  its Q4_1 GGUF; ``-t`` threads, greedy, through ``/completion`` with the same prompt
  ids; the figure is the server's own ``timings.predicted_per_token_ms``.
- ``gemv``: one ``F.linear`` with one row per weight matrix a step reads (``floor.py``'s
  sweep) in fp32 and bf16; also prepacked (the kernels frozen inductor calls: MKL's
  packed sgemm for fp32, oneDNN for bf16) and with oneDNN off; ms and GB/s.
- ``gemv_env``: the fp32 and bf16 sweeps under each threading setting of :data:`ENVS`.

``--quick`` is a smoke run: the small random model, 1 thread, 8 tokens. The last line
printed is one JSON object.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import resource
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import torch
from common import emit, median, reference_model, timed
from floor import _input_embedding, gemv_sweep, step_weight_bytes

#: One prompt for every model: prose that a trained model continues without ending it.
PROMPT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
          "combined movable metal type, oil-based ink and a wooden screw press. Within fifty years,")

#: name: (weights' dtype, ``compile=`` of ``models.transformers``, oneDNN on). A dict of
#: ``compile=`` is inductor's options, set around the compiled step. With oneDNN off
#: (``torch.backends.mkldnn``), bf16 products go to ATen's own kernels.
VARIANTS = {
    "eager": (torch.float32, False, True),
    "compiled": (torch.float32, True, True),
    "frozen": (torch.float32, {"freezing": True}, True),
    "autotune": (torch.float32, "max-autotune", True),
    "autotune_frozen": (torch.float32, {"freezing": True, "max_autotune": True}, True),
    "bf16": (torch.bfloat16, False, True),
    "bf16_no_mkldnn": (torch.bfloat16, False, False),
    "bf16_frozen": (torch.bfloat16, {"freezing": True}, True),
}

#: Threading settings tried on the GEMV sweep, each in a fresh process: environment
#: variables, or ``interop`` for ``torch.set_num_interop_threads``. "THREADS" is replaced by
#: the thread count. torch's wheels use GNU OpenMP, so ``KMP_*`` (Intel OpenMP's) should do
#: nothing: it is kept to show that.
ENVS = {
    "default": {},
    "OMP_NUM_THREADS": {"OMP_NUM_THREADS": "THREADS"},
    "OMP_WAIT_POLICY=PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"},
    "OMP_WAIT_POLICY=ACTIVE": {"OMP_WAIT_POLICY": "ACTIVE"},
    "KMP_BLOCKTIME=0": {"KMP_BLOCKTIME": "0"},
    "MKL_ENABLE_INSTRUCTIONS=AVX2": {"MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "MKL_ENABLE_INSTRUCTIONS=AVX512": {"MKL_ENABLE_INSTRUCTIONS": "AVX512"},
    "interop=1": {"interop": "1"},
}
QUICK_ENVS = ("default", "OMP_WAIT_POLICY=PASSIVE", "interop=1")


def load(name: str):
    """(fp32 HF model, tokenizer, folder) of "smollm2" (SmolLM2-135M-Instruct), "mid" or "small"."""
    if name != "smollm2":
        return reference_model(name)
    from support.real import smollm2
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = smollm2()
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval(), \
        AutoTokenizer.from_pretrained(folder), folder


def memory_mb() -> dict:
    """This process's resident memory now and at its peak (compiling, autotuning), MB."""
    now = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    return {"rss_mb": round(now, 1), "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}


# ----- cells: each runs in its own process (see main) -----

def ours(cell: dict) -> dict:
    """ms per token of a variant of ``continuous(generate.text(model))``, and its token ids."""
    from continuous import continuous, generate, models

    dtype, compile, onednn = VARIANTS[cell["variant"]]
    torch.backends.mkldnn.set_flags(onednn)
    hf, tok, _ = load(cell["model"])
    model = models.transformers(hf, tok, dtype=dtype, compile=compile)
    gen = continuous(generate.text(model))
    base = gen(PROMPT, max_tokens=0)  # the prefill, with the logits of the first token kept
    first, warm_s = timed(lambda: gen(base, max_tokens=cell["tokens"]))  # compiles each shape once
    runs = []
    for _ in range(cell["reps"]):
        before = model.stats.forward_calls
        out, t = timed(lambda: gen(base, max_tokens=cell["tokens"]))
        runs.append(t / (model.stats.forward_calls - before))
    n_prompt = int(base.attention_mask.sum())
    ids = out.token_ids[0][out.attention_mask[0].bool()].tolist()
    assert ids == first.token_ids[0][first.attention_mask[0].bool()].tolist(), "greedy outputs moved between runs"
    return {"ms": median(runs) * 1e3, "ids": ids[n_prompt:], "prompt_ids": ids[:n_prompt],
            "first_run_s": round(warm_s, 2)} | memory_mb()


class _Clock:
    """A ``generate`` streamer that notes when each token arrives (the first ``put`` is the prompt)."""

    def __init__(self):
        self.times = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


def hf_generate(cell: dict) -> dict:
    """ms per token of transformers' ``generate`` on the prompt ids, from its first token to its last."""
    hf, tok, _ = load(cell["model"])
    ids = torch.tensor([cell["prompt_ids"]])
    n = cell["n"]  # the tokens ours generated: the same count, or the same EOS
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                  pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
    with torch.inference_mode():
        hf.generate(ids, **kwargs)  # warm
        runs = []
        for _ in range(cell["reps"]):
            clock = _Clock()
            out = hf.generate(ids, streamer=clock, **kwargs)
            generated = len(clock.times) - 1
            runs.append((clock.times[-1] - clock.times[1]) / max(generated - 1, 1))
    return {"ms": median(runs) * 1e3, "ids": out[0, ids.shape[1]:].tolist()} | memory_mb()


def matrices(hf) -> list[torch.Tensor]:
    """The weight matrices a decode step reads (as ``floor.gemv_sweep`` sweeps them)."""
    embedding, tied = _input_embedding(hf)
    return [p.detach() for p in hf.parameters() if p.dim() == 2 and (p is not embedding or tied)]


#: How torch words a kernel's refusal to run without an instruction set.
CPU_SUPPORT = "needs the cpu support"


def bf16_packing() -> str | None:
    """Why oneDNN cannot prepack bf16 weights on this CPU (``None`` where it can).

    Its bf16 layout needs avx512bw, avx512vl and avx512dq (or avx_ne_convert); an
    AVX2-only CPU has none of them, and the reorder raises.
    """
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return None
    return "oneDNN's bf16 weight packing needs avx512bw+avx512vl+avx512dq or avx_ne_convert, which this CPU lacks"


def packed_sweep(weights: list[torch.Tensor]) -> float:
    """Seconds of the GEMV sweep through prepacked weights: the calls frozen inductor makes.

    fp32 goes to MKL's packed sgemm; bf16 to oneDNN's linear on its own weight layout.
    """
    fp32 = weights[0].dtype == torch.float32
    if fp32:
        packs = [(torch.ops.mkl._mkl_reorder_linear_weight(w, 1), w) for w in weights]
        linear = lambda x, p, w: torch.ops.mkl._mkl_linear(x, p, w, None, 1)  # noqa: E731
    else:
        packs = [(torch.ops.mkldnn._reorder_linear_weight(w, 1), w) for w in weights]
        linear = lambda x, p, w: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")  # noqa: E731
    inputs = {w.shape[1]: torch.randn(1, w.shape[1], dtype=w.dtype) for w in weights}

    def sweep():
        for p, w in packs:
            linear(inputs[w.shape[1]], p, w)

    with torch.inference_mode():
        sweep()
        return min(timed(sweep)[1] for _ in range(20))


def gemv(cell: dict) -> dict:
    """ms of the bare GEMV sweeps: fp32 and bf16; with ``full``, also prepacked and with oneDNN off.

    A sweep this CPU cannot run is left out, its reason under ``unavailable``.
    """
    hf = load(cell["model"])[0]
    bf16 = copy.deepcopy(hf).to(torch.bfloat16)
    out, unavailable = {"fp32": gemv_sweep(hf), "bf16": gemv_sweep(bf16)}, {}
    if cell.get("full"):
        out["fp32_packed"] = packed_sweep(matrices(hf))
        if (why := bf16_packing()) is None:
            out["bf16_packed"] = packed_sweep(matrices(bf16))
        else:
            unavailable["bf16_packed"] = why
        with torch.backends.mkldnn.flags(enabled=False):
            out["fp32_no_mkldnn"], out["bf16_no_mkldnn"] = gemv_sweep(hf), gemv_sweep(bf16)
    return {k: v * 1e3 for k, v in out.items()} | {"bytes": {"fp32": step_weight_bytes(hf),
                                                              "bf16": step_weight_bytes(bf16)},
                                                    "unavailable": unavailable}


CELLS = {"ours": ours, "hf": hf_generate, "gemv": gemv}


def run_cell(cell: dict) -> dict:
    """In this process: set the threads, then run the cell."""
    if cell.get("interop"):
        torch.set_num_interop_threads(int(cell["interop"]))  # only before any parallel work
    torch.set_num_threads(cell["threads"])
    return CELLS[cell["kind"]](cell)


def in_process(cell: dict, env: dict | None = None) -> dict:
    """A cell in a fresh process (with extra environment variables): its JSON result."""
    proc = subprocess.run([sys.executable, __file__, "--cell", json.dumps(cell)], capture_output=True, text=True,
                          env=dict(os.environ, **(env or {})), cwd=Path(__file__).parent)
    if proc.returncode:
        raise RuntimeError(f"cell {cell} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    what = " ".join(str(cell.get(k)) for k in ("model", "threads", "kind", "variant") if cell.get(k)) + \
        "".join(f" {k}={v}" for k, v in (env or {}).items())
    print(f"{what}: {result['ms']:.2f} ms" if "ms" in result else what, file=sys.stderr, flush=True)
    return result


# ----- llama.cpp's server -----

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict | None = None, timeout: float = 600) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


@contextmanager
def llama_server(binary: Path, gguf: Path, threads: int):
    """``llama-server`` on one GGUF file with ``threads`` threads; yields its URL once loaded."""
    port, log = free_port(), tempfile.TemporaryFile("w+")  # a file: a full pipe would block its logging
    proc = subprocess.Popen([str(binary), "-m", str(gguf), "-t", str(threads), "-tb", str(threads), "-c", "2048",
                             "-np", "1", "--host", "127.0.0.1", "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"llama-server exited: {log.read()[-2000:]}")
            try:
                post(f"{url}/health", timeout=5)
                break
            except OSError:  # not listening yet, or 503 while loading
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def llamacpp(binary: Path, gguf: Path, threads: int, prompt_ids: list[int], n: int, reps: int) -> dict:
    """The server's own ms per generated token (median of ``reps``) and its greedy token ids."""
    body = {"prompt": prompt_ids, "n_predict": n, "temperature": 0, "top_k": 1, "cache_prompt": False,
            "return_tokens": True}
    with llama_server(binary, gguf, threads) as url:
        post(f"{url}/completion", body)  # warm
        runs = [post(f"{url}/completion", body) for _ in range(reps)]
    return {"ms": median([r["timings"]["predicted_per_token_ms"] for r in runs]), "ids": runs[-1].get("tokens")}


def llamacpp_cells(name: str, folder: Path, threads: int, prompt_ids, n: int, reps: int) -> tuple[dict, dict]:
    """({competitor: result}, {competitor: why skipped}) for llama.cpp on this model."""
    from support import llamacpp as support

    binary = support.llama_server()
    if binary is None:
        return {}, {"llamacpp": "llama-server is not built (python tests/support/llamacpp.py server)"}
    files, skipped = {}, {}
    try:
        files["llamacpp_f32"] = support.f32_gguf(folder)
    except subprocess.CalledProcessError as e:
        reason = (e.stderr or b"").decode(errors="replace").strip().splitlines()[-1:] or ["failed"]
        skipped["llamacpp_f32"] = f"convert_hf_to_gguf.py: {reason[0]}"
    if name == "smollm2":
        from support.real import smollm2_gguf

        files["llamacpp_q4_1"] = smollm2_gguf()
    return {k: llamacpp(binary, f, threads, prompt_ids, n, reps) for k, f in files.items()}, skipped


# ----- the table -----

def cpu_flags() -> dict:
    """The CPU's name and the flags that decide the bf16 paths."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    name = re.search(r"model name\s*:\s*(.*)", text)
    flags = re.search(r"^flags\s*:\s*(.*)$", text, re.M)
    flags = set(flags.group(1).split()) if flags else set()
    return {"name": name.group(1) if name else None, "cores": os.cpu_count(),
            "avx512_bf16": "avx512_bf16" in flags, "amx_bf16": "amx_bf16" in flags, "avx512f": "avx512f" in flags,
            "torch_capability": torch.backends.cpu.get_cpu_capability()}


def one_config(name: str, threads: int, args) -> dict:
    """Every figure of one model at one thread count."""
    cell = {"model": name, "threads": threads, "tokens": args.tokens, "reps": args.reps}
    figures, skipped = {}, {}
    wanted = lambda k: not args.only or k in args.only  # noqa: E731
    eager = in_process(cell | {"kind": "ours", "variant": "eager"})
    figures["eager"] = eager
    for variant in VARIANTS:
        if variant != "eager" and wanted(variant):
            try:
                figures[variant] = in_process(cell | {"kind": "ours", "variant": variant})
            except RuntimeError as exc:  # a kernel this CPU lacks: the figure is unavailable, not the run
                if CPU_SUPPORT not in str(exc):
                    raise
                skipped[variant] = str(exc).splitlines()[-1]
    prompt_ids, n = eager["prompt_ids"], len(eager["ids"])
    if wanted("hf"):
        figures["hf"] = in_process(cell | {"kind": "hf", "prompt_ids": prompt_ids, "n": n})
    if wanted("llamacpp"):
        found, missing = llamacpp_cells(name, load_folder(name), threads, prompt_ids, n, args.reps)
        figures, skipped = figures | found, skipped | missing
    result = {"ms_per_token": {k: round(v["ms"], 2) for k, v in figures.items()},
              "same_as_eager": {k: v["ids"] == eager["ids"] for k, v in figures.items() if k != "eager"},
              "first_run_s": {k: v["first_run_s"] for k, v in figures.items() if "first_run_s" in v},
              "rss_mb": {k: v["rss_mb"] for k, v in figures.items() if "rss_mb" in v},
              "peak_rss_mb": {k: v["peak_rss_mb"] for k, v in figures.items() if "peak_rss_mb" in v},
              "tokens": n, "skipped": skipped}
    if wanted("gemv"):
        result |= gemv_figures(cell, args)
    return result


def load_folder(name: str) -> Path:
    if name == "smollm2":
        from support.real import smollm2

        return smollm2()
    return reference_model(name)[2]


def gemv_figures(cell: dict, args) -> dict:
    """The sweeps (ms and GB/s), then the fp32 and bf16 sweeps' GB/s under each threading setting."""
    sweeps = in_process(cell | {"kind": "gemv", "full": True})
    size, unavailable = sweeps.pop("bytes"), sweeps.pop("unavailable")
    gb_s = lambda kind, ms: round(size[kind.split("_")[0]] / ms / 1e6, 2)  # noqa: E731
    out = {"gemv": {k: {"ms": round(ms, 2), "gb_s": gb_s(k, ms)} for k, ms in sweeps.items()}, "gemv_env": {},
           "gemv_unavailable": unavailable}
    for env_name in QUICK_ENVS if args.quick else ENVS:
        env = {k: v.replace("THREADS", str(cell["threads"])) for k, v in ENVS[env_name].items()}
        interop = env.pop("interop", None)
        found = in_process(cell | {"kind": "gemv", "interop": interop}, env)
        out["gemv_env"][env_name] = {k: gb_s(k, found[k]) for k in ("fp32", "bf16")}
    return out


def table(results: dict) -> list[tuple]:
    rows = [("model", "threads", "figure", "ms/token", "same as eager", "first run s", "MB (peak)")]
    for name, by_threads in results.items():
        for threads, r in by_threads.items():
            for k, ms in r["ms_per_token"].items():
                rows.append((name, threads, k, f"{ms:.2f}", r["same_as_eager"].get(k, ""),
                             r["first_run_s"].get(k, ""),
                             f"{r['rss_mb'][k]:.0f} ({r['peak_rss_mb'][k]:.0f})" if k in r["rss_mb"] else ""))
            for k, g in r.get("gemv", {}).items():
                rows.append((name, threads, f"gemv {k}", f"{g['ms']:.2f}", f"{g['gb_s']} GB/s", "", ""))
            for k, g in r.get("gemv_env", {}).items():
                rows.append((name, threads, f"gemv {k}", "", f"fp32 {g['fp32']}, bf16 {g['bf16']} GB/s", "", ""))
            for k, why in r.get("gemv_unavailable", {}).items():
                rows.append((name, threads, f"gemv {k}", "unavailable", why[:80], "", ""))
            for k, why in r["skipped"].items():
                rows.append((name, threads, k, "skipped", why[:80], "", ""))
    return rows


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the small model, 1 thread, 8 tokens")
    parser.add_argument("--save", action="store_true", help="write benchmarks/results/cpu.json")
    parser.add_argument("--reps", type=int, default=3, help="timed runs in each cell (median)")
    parser.add_argument("--models", nargs="+", choices=("smollm2", "mid", "small"), help="default: smollm2 mid")
    parser.add_argument("--threads", nargs="+", type=int, help="torch threads (default: 1 2)")
    parser.add_argument("--tokens", type=int, help="tokens decoded (default 128)")
    parser.add_argument("--only", nargs="+", help="run only these of the variants, hf, llamacpp, gemv (eager always)")
    parser.add_argument("--cell", help=argparse.SUPPRESS)  # a cell's JSON, run in this process
    args = parser.parse_args()
    args.models = args.models or (["small"] if args.quick else ["smollm2", "mid"])
    args.threads = args.threads or ([1] if args.quick else [1, 2])
    args.tokens = args.tokens or (8 if args.quick else 128)
    return args


def main():
    args = parse_args()
    if args.cell:
        print(json.dumps(run_cell(json.loads(args.cell))))
        return
    results = {name: {str(t): one_config(name, t, args) for t in args.threads} for name in args.models}
    emit("cpu", table(results), {"bench": "cpu", "cpu": cpu_flags(), "torch": torch.__version__,
                                 "tokens": args.tokens, "reps": args.reps, "models": results}, args.save)


if __name__ == "__main__":
    main()
