"""Shared by the benchmarks: reference models cached on disk, timing, and the JSON last line."""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
MODELS = ROOT / ".models"


def reference_model(size: str):
    """The BENCHMARKS.md reference model of this size (built once, then loaded from disk)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from continuous.testing import build_model_dir

    path = build_model_dir(MODELS / size, size=size, seed=0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path), path


def timed(fn):
    """(result, seconds) of one call."""
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def median(xs):
    return statistics.median(xs)


def emit(table: list[tuple], result: dict) -> None:
    """Print a table (first row is the header), then the JSON line."""
    widths = [max(len(str(row[i])) for row in table) for i in range(len(table[0]))]
    for row in table:
        print("  ".join(str(c).rjust(w) for c, w in zip(row, widths)))
    print(json.dumps(result))
    sys.stdout.flush()
