"""Draw docs/img/multiturn.png from benchmarks/results/multiturn.json (written by multiturn.py --save).

    python benchmarks/plot.py
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no screen needed
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parent


def main() -> None:
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
    out = ROOT.parent / "docs" / "img" / "multiturn.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(out)


if __name__ == "__main__":
    main()
