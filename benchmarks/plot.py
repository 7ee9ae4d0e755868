"""Draw the figures of docs/benchmarks.md from the results files (written by the benchmarks' --save).

    python benchmarks/plot.py

- ``docs/img/multiturn.png``: per-turn latency of a multi-turn JSON chat (``multiturn.json``);
- ``docs/img/clients.png``: generated tokens/s against the number of clients on SmolLM2
  (``serve.json``): concurrent calls on one model, one call holding the same prompts as a
  batch, the OpenAI server, transformers' ``generate_batch``; and, on the same model as a
  GGUF through llama.cpp (``llamacpp.json``), our concurrent calls and llama-server's.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no screen needed
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parent
IMG = ROOT.parent / "docs" / "img"


def _save(fig, name: str) -> None:
    IMG.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(IMG / name, dpi=120)
    print(IMG / name)


def multiturn() -> None:
    result = json.loads((ROOT / "results" / "multiturn.json").read_text())
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, style in (("outlines", "s-"), ("continuous", "o-"), ("ideal", "--")):
        seconds = result["per_turn_seconds"][name]
        ax.plot(range(1, len(seconds) + 1), seconds, style, label=name)
    ax.set_xlabel("turn")
    ax.set_ylabel("seconds per turn (median)")
    ax.set_title(f"Multi-turn JSON chat, {result['model']} model: per-turn latency")
    ax.set_ylim(bottom=0)
    ax.legend()
    _save(fig, "multiturn.png")


def clients() -> None:
    serve = json.loads((ROOT / "results" / "serve.json").read_text())
    runs = serve["models"]["smollm2"]
    library, server = runs["library"], runs.get("server", {})
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [3, 2]})
    n = sorted(int(k) for k in library["tokens_per_s"])
    left.plot(n, [library["tokens_per_s"][str(k)] for k in n], "o-", label="concurrent calls (acall)")
    left.plot(n, [library["one_call_tokens_per_s"][str(k)] for k in n], "s--", label="one call, prompts as a batch")
    if "concurrency" in server:
        m = sorted(int(k) for k in server["concurrency"])
        left.plot(m, [server["concurrency"][str(k)]["tokens_per_s"] for k in m], "^-", label="OpenAI server (HTTP)")
    left.plot([max(n)], [library["generate_batch_tokens_per_s"]], "kx", markersize=9,
              label="transformers generate_batch")
    left.set(xlabel="clients", ylabel="generated tokens/s", xscale="log", xticks=n, xticklabels=[str(k) for k in n],
             title=f"transformers backend, {serve['threads']} torch thread")
    left.set_ylim(bottom=0)
    left.legend(fontsize=8)
    path = ROOT / "results" / "llamacpp.json"
    if path.exists():
        result = json.loads(path.read_text())
        concurrent = result["f32"]["concurrent"]
        right.bar(["continuous\n(models.llamacpp)", "llama-server"], [concurrent["ours"], concurrent["server"]],
                  color=["C0", "C3"])
        right.set(ylabel="generated tokens/s",
                  title=f"F32 GGUF, {concurrent['clients']} clients, {result['sizes']['shared']} threads")
    else:
        right.set_axis_off()
    fig.suptitle("SmolLM2-135M-Instruct, greedy, on this machine's CPU")
    _save(fig, "clients.png")


def main() -> None:
    multiturn()
    clients()


if __name__ == "__main__":
    main()
