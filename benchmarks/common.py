"""Shared by the benchmarks: reference models cached on disk, token counting, tables, JSON."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
# This folder holds benchmarks named after packages (jsonschema.py): a script run from
# here has the folder first on its path, where it would hide the package of that name
# from every library (outlines imports jsonschema). Scripts still find each other last.
if sys.path and os.path.realpath(sys.path[0] or ".") == str(ROOT):
    sys.path.append(sys.path.pop(0))
sys.path.append(str(ROOT.parent / "tests"))  # the test tools: models and real tokenizers built offline

import torch  # noqa: E402

MODELS = ROOT / ".models"
RESULTS = ROOT / "results"


def parse_args(description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="reduced size, under a minute")
    parser.add_argument("--save", action="store_true", help="write benchmarks/results/NAME.json")
    parser.add_argument("--reps", type=int, default=3, help="repetitions of each competitor")
    return parser.parse_args()


def setup(description: str):
    """Parse the arguments and load the model: "small" with --quick, else "mid".

    Returns (args, size, HF model, tokenizer, continuous model).
    """
    from continuous import models

    args = parse_args(description)
    size = "small" if args.quick else "mid"
    hf, tok, _ = reference_model(size)
    return args, size, hf, tok, models.transformers(hf, tok)


def reference_model(size: str):
    """The reference model of this size ("small" or "mid"), built once then loaded from disk.

    Returns (HF model, tokenizer, path).
    """
    from support.models import build_model_dir
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = build_model_dir(MODELS / size, size=size, seed=0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path), path


def random_text(tokenizer, n_tokens: int, seed: int) -> str:
    """Text of about ``n_tokens`` tokens drawn from the synthetic corpus (reproducible)."""
    import random

    from support.models import corpus

    lines = corpus(400, seed)
    random.Random(seed).shuffle(lines)
    text, ids = "", []
    for line in lines:
        text += line + "\n"
        ids = tokenizer(text, add_special_tokens=False).input_ids
        if len(ids) >= n_tokens:
            break
    return tokenizer.decode(ids[:n_tokens])


@contextlib.contextmanager
def count_positions(hf_model):
    """Count token positions sent through the transformer blocks of an HF model."""
    counter = {"tokens": 0, "calls": 0}

    def hook(module, args, kwargs):
        x = kwargs.get("input_ids")
        if x is None:
            x = kwargs.get("inputs_embeds")
        if x is None and args:
            x = args[0]
        counter["tokens"] += x.shape[0] * x.shape[1]
        counter["calls"] += 1

    handle = hf_model.model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield counter
    finally:
        handle.remove()


def timed(fn):
    """(result, seconds) of one call."""
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def median(xs):
    return statistics.median(xs)


def emit(name: str, table: list[tuple], result: dict, save: bool) -> None:
    """Print a table (first row is the header), then the JSON line; save it with --save."""
    widths = [max(len(str(row[i])) for row in table) for i in range(len(table[0]))]
    for row in table:
        print("  ".join(str(c).rjust(w) for c, w in zip(row, widths)))
    if save:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    sys.stdout.flush()
