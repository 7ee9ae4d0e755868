"""MaskBench (JSONSchemaBench) on both constraint engines: coverage, correctness, compile and mask time.

Every schema is compiled by each engine (in a worker process, under a per-schema time
limit, so that one blow-up cannot hang the run), then every valid and invalid instance
of the schema is fed token by token with the Llama-3 tokenizer: before each token the
row's mask is filled (that time is the mask time) and the token must be allowed; the
grammar accepts an instance when all of its tokens are allowed and the text is a
complete match at the end (EOS allowed). llguidance is the default path: a schema it
refuses only over keywords that narrow it is compiled relaxed, what it dropped is
watched while decoding, and ``value`` is validated; an instance reaches the user when
the grammar, the watch and the validation all take it.

``--generate N`` also generates from N of the relaxed schemas with a random-weight model
of the Llama-3 tokenizer (or, with ``--generate-model smollm2``, the trained
SmolLM2-135M-Instruct): how many finish with a valid value, how many raise, and
whether any value that fails validation is returned without an error.

Instances are serialized as compact JSON (``separators=(",", ":")``, non-ASCII kept),
which both engines' default whitespace rules allow, with each object's members in the
order of its schema's ``properties`` (JSON objects are unordered; llguidance writes
members in that order, see :func:`in_schema_order`). ``valid_as_written`` counts the
valid instances the grammar takes in their file's member order.

Usage::

    python benchmarks/jsonschema.py [--data DIR_OR_TGZ] [--full | --quick] [--jobs N] [--save]

Without ``--data`` the ``maskbench/data`` folder of github guidance-ai/jsonschemabench at
a pinned commit is downloaded once into the cache (``$CONTINUOUS_CACHE`` or
``~/.cache/continuous``).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import sys
import tarfile
import time
from multiprocessing import connection, get_context
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # workers are forked
# This file's folder comes first on the path of a script run from it, where this file
# would hide the jsonschema package from every library: the repository root instead.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

from benchmarks.common import emit  # noqa: E402

ENGINES = ("llguidance", "outlines_core")
#: The jsonschemabench commit whose ``maskbench/data`` is the default data set.
PINNED = "ba103c73756198dd9b149ddc7db7867da7a077f6"
URL = f"https://codeload.github.com/guidance-ai/jsonschemabench/tar.gz/{PINNED}"
#: Time for feeding one schema's instances once it compiled (a hang there is a failure too).
EVAL_LIMIT_S = 300.0

_TOKENIZER = None  # set in the parent before the workers fork


# ------------------------------------------------------------------------- data
def _is_case(name: str) -> bool:
    base = name.rsplit("/", 1)[-1]
    return base.endswith(".json") and "---" in base


def _default_archive() -> Path:
    """The pinned jsonschemabench tarball, downloaded once into the cache."""
    import urllib.request

    from support.models import cache_dir

    out = cache_dir() / "jsonschemabench" / f"{PINNED}.tar.gz"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".part")
        print(f"downloading {URL} (once) ...", file=sys.stderr)
        with urllib.request.urlopen(URL) as src:
            tmp.write_bytes(src.read())
        tmp.replace(out)
    return out


def load_cases(data: str | None, per_split: int | None, seed: int = 0) -> list[tuple[str, dict]]:
    """(name, case) pairs: ``per_split`` schemas per split drawn with ``seed`` (all when ``None``).

    ``data`` is a folder of ``<Split>---<id>.json`` files, a ``.tgz`` holding them (a
    ``maskbench/data`` folder of the repository is recognized), or ``None`` for the
    pinned download.
    """
    path = Path(data) if data else _default_archive()
    if path.is_dir():
        files = {p.name: p for p in sorted(path.rglob("*.json")) if _is_case(p.name)}
        names = sorted(files)
    else:
        with tarfile.open(path) as tar:
            # In the repository's tarball only maskbench/data holds cases.
            names = sorted(m.name.rsplit("/", 1)[-1] for m in tar
                           if m.isfile() and _is_case(m.name)
                           and ("maskbench/" not in m.name or "/maskbench/data/" in m.name))
    if not names:
        raise SystemExit(f"no <Split>---<id>.json files in {path}")
    splits = collections.defaultdict(list)
    for name in names:
        splits[name.split("---", 1)[0]].append(name)
    rng = random.Random(seed)
    chosen = []
    for split in sorted(splits):
        group = splits[split]
        chosen += group if per_split is None or per_split >= len(group) else sorted(rng.sample(group, per_split))
    if path.is_dir():
        found = {name: json.loads(files[name].read_text()) for name in chosen}
    else:
        # One sequential pass: a member read out of order makes gzip start again from the top.
        wanted, found = set(chosen), {}
        with tarfile.open(path, mode="r|gz") as tar:
            for m in tar:
                base = m.name.rsplit("/", 1)[-1]
                if m.isfile() and base in wanted and base not in found and _is_case(m.name) \
                        and ("maskbench/" not in m.name or "/maskbench/data/" in m.name):
                    found[base] = json.loads(tar.extractfile(m).read())
    return [(name, found[name]) for name in chosen]


# ---------------------------------------------------------------------- workers
def _compile(engine: str, schema):
    if engine == "llguidance":
        from continuous.engines import llguidance as mod
    else:
        from continuous.engines import outlines_core as mod
    return mod.json_schema(schema, _TOKENIZER)


def in_schema_order(value, schema):
    """``value`` with each object's members in the order of its schema's ``properties``.

    JSON objects are unordered, but llguidance writes (and takes) members in the order the
    schema lists them, as any generator constrained by it would: an instance is fed in
    that order (what a ``$ref`` or ``allOf`` brings first, then the node's own). Where
    ``anyOf``/``oneOf`` branches apply, the one the value satisfies gives the order;
    members no schema lists come last, as they were.
    """
    from continuous.engines.jsonwatch import Checks

    try:
        checks = Checks(schema, set())
    except Exception:  # a schema jsonschema cannot read
        return value

    def nodes(node, value):
        # What a node takes from its $ref and allOf members comes before its own members.
        expanded = checks._expand(node)
        out = []
        for n in expanded[1:] + expanded[:1]:
            out.append(n)
            for branch in n.get("anyOf", []) + n.get("oneOf", []):
                if isinstance(branch, dict) and not checks.errors(branch, value):
                    out += nodes(branch, value)
        return out

    def order(value, node_list):
        if isinstance(value, list):
            return [order(v, [m for n in node_list for s in checks._step(n, i) for m in nodes(s, v)])
                    for i, v in enumerate(value)]
        if not isinstance(value, dict):
            return value
        keys = [k for n in node_list for k in n.get("properties", {})]
        rank = {k: i for i, k in reversed(list(enumerate(keys)))}
        members = sorted(value, key=lambda k: rank.get(k, len(rank)))
        return {k: order(value[k], [m for n in node_list for s in checks._step(n, k) for m in nodes(s, value[k])])
                for k in members}

    return order(value, nodes(schema, value))


def _checks(constraint, schema):
    """Whether an instance's text passes the watch (what the grammar dropped) and the validation."""
    from continuous.engines.schema import validator

    try:
        check = validator(schema)
    except Exception:  # a schema jsonschema cannot read: the library refuses it at build too
        check = None

    def passes(text: str) -> tuple[bool, bool]:
        watch = constraint.watch()
        watched = watch is None or not (watch.feed(text) or watch.finish())
        try:
            valid = check is not None and check.is_valid(json.loads(text))
        except Exception:
            valid = False
        return watched, valid

    return passes


def _feed(constraint, text: str, mask_us: list[float]) -> bool:
    """Feed ``text`` token by token; whether every token was allowed and the end accepts."""
    import torch

    ids = _TOKENIZER.encode(text, add_special_tokens=False)
    row = torch.zeros(constraint.words, dtype=torch.int32)
    m = constraint.matcher()
    for t in ids:
        t0 = time.perf_counter()
        m.fill(row)
        mask_us.append((time.perf_counter() - t0) * 1e6)
        if not (int(row[t // 32]) >> (t % 32)) & 1:
            return False
        m.advance(t)
    m.fill(row)
    eos = _TOKENIZER.eos_token_id
    return m.accepting() and bool((int(row[eos // 32]) >> (eos % 32)) & 1)


def _clear_caches(engine: str) -> None:
    # A worker compiles thousands of distinct schemas once each: drop the indexes so
    # its memory stays that of one schema (the library caches them for reuse).
    if engine == "outlines_core":
        from continuous.engines import caches

        caches.clear(compiled_only=True)


def _serve(conn) -> None:
    while True:
        task = conn.recv()
        if task is None:
            return
        engine, case = task
        t0 = time.perf_counter()
        try:
            constraint = _compile(engine, case["schema"])
        except Exception as exc:  # a refusal is a result: the message says which keyword
            conn.send(("compiled", False, (time.perf_counter() - t0) * 1e3, str(exc).splitlines()[0][:200]))
            continue
        conn.send(("compiled", True, (time.perf_counter() - t0) * 1e3, None))
        counts = collections.Counter(relaxed=int(bool(constraint.dropped)))
        mask_us: list[float] = []
        passes = _checks(constraint, case["schema"])
        for test in case["tests"]:
            text = json.dumps(test["data"], separators=(",", ":"), ensure_ascii=False)
            ordered = json.dumps(in_schema_order(test["data"], case["schema"]), separators=(",", ":"),
                                 ensure_ascii=False)
            try:
                ok = _feed(constraint, ordered, mask_us)
                counts[f"{'valid' if test['valid'] else 'invalid'}_as_written"] += ordered == text or \
                    _feed(constraint, text, [])
            except (ValueError, RuntimeError):  # a refused token, or the engine hit a limit
                ok = False
            watched, valid = passes(text) if ok else (False, False)
            kind = "valid" if test["valid"] else "invalid"
            counts[f"{kind}_total"] += 1
            counts[f"{kind}_grammar"] += ok
            counts[f"{kind}_accepted"] += ok and watched  # taken while decoding
            counts[f"{kind}_to_user"] += ok and watched and valid  # returned as value without an error
        conn.send(("done", dict(counts), mask_us))
        del constraint
        _clear_caches(engine)


class _Worker:
    def __init__(self, ctx):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child,), daemon=True)
        self.proc.start()
        child.close()
        self.task = None
        self.deadline = None

    def kill(self):
        self.proc.kill()
        self.proc.join()
        self.conn.close()


def run_all(cases, engines, jobs: int, timeout_s: float, progress: bool = True) -> dict:
    """Results per (engine, case name): compile status and time, instance counts, mask times."""
    ctx = get_context("fork")
    workers = [_Worker(ctx) for _ in range(jobs)]
    pending = collections.deque((e, name, case) for name, case in cases for e in engines)
    results: dict = {}
    total = len(pending)

    def finish(w, **res):
        results[(w.task[0], w.task[1])] = res
        w.task = None
        if progress and len(results) % 50 == 0:
            print(f"  {len(results)}/{total}", file=sys.stderr, flush=True)

    try:
        while pending or any(w.task for w in workers):
            for i, w in enumerate(workers):
                if w.task is None and pending:
                    engine, name, case = pending.popleft()
                    w.task = (engine, name, None)
                    w.deadline = time.monotonic() + timeout_s
                    w.conn.send((engine, case))
            busy = [w for w in workers if w.task]
            wait = max(0.0, min(w.deadline for w in busy) - time.monotonic())
            ready = connection.wait([w.conn for w in busy], timeout=wait)
            for w in busy:
                if w.conn in ready:
                    try:
                        msg = w.conn.recv()
                    except EOFError:  # the worker died (a crash in native code)
                        finish(w, compiled=False, compile_ms=w.task[2] or 0.0, error="worker died")
                        w.kill()
                        workers[workers.index(w)] = _Worker(ctx)
                        continue
                    if msg[0] == "compiled":
                        _, ok, ms, err = msg
                        if ok:
                            w.task = (w.task[0], w.task[1], ms)
                            w.deadline = time.monotonic() + EVAL_LIMIT_S
                        else:
                            finish(w, compiled=False, compile_ms=ms, error=err)
                    else:
                        _, counts, mask_us = msg
                        finish(w, compiled=True, compile_ms=w.task[2], counts=counts, mask_us=mask_us)
                elif time.monotonic() >= w.deadline:
                    phase = "compile" if w.task[2] is None else "instances"
                    ms = timeout_s * 1e3 if w.task[2] is None else w.task[2]
                    finish(w, compiled=False, compile_ms=ms, error=f"timeout ({phase})", timeout=True)
                    w.kill()
                    workers[workers.index(w)] = _Worker(ctx)
    finally:
        for w in workers:
            if w.task is None:
                w.conn.send(None)
            w.kill()
    return results


# ---------------------------------------------------------------------- figures
def _pct(xs, q):
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def summarize(results, cases, engines) -> dict:
    out = {}
    for e in engines:
        rows = [results[(e, name)] for name, _ in cases]
        ok = [r for r in rows if r["compiled"]]
        # A compile that ran out of time counts at the limit (a lower bound); refusals
        # are fast and would flatter the percentiles, so they are left out.
        times = [r["compile_ms"] for r in rows if r["compiled"] or r.get("timeout")]
        masks = [us for r in ok for us in r["mask_us"]]
        agg = {k: sum(r["counts"].get(k, 0) for r in ok)
               for k in ("valid_grammar", "valid_accepted", "valid_to_user", "valid_as_written", "valid_total",
                         "invalid_grammar", "invalid_accepted", "invalid_to_user", "invalid_total")}
        out[e] = {
            "schemas": len(rows),
            "compile_ok": len(ok),
            "compile_relaxed": sum(r["counts"].get("relaxed", 0) for r in ok),
            "compile_timeouts": sum(bool(r.get("timeout")) for r in rows),
            "compile_p50_ms": round(_pct(times, 0.50), 2) if times else None,
            "compile_p95_ms": round(_pct(times, 0.95), 2) if times else None,
            **agg,
            "mask_p50_us": round(_pct(masks, 0.50), 1) if masks else None,
            "mask_p99_us": round(_pct(masks, 0.99), 1) if masks else None,
        }
    return out


def choose_default(figures: dict) -> str:
    """The engine that clears the bar (compiles at least as many as llguidance, returns no
    invalid instance, compile p95 < 50 ms); among those the one that compiles most, then
    the faster mask. llguidance when none clears it (it is the reference of the bar)."""
    best = figures["llguidance"]["compile_ok"] if "llguidance" in figures else 0
    fits = [e for e, f in figures.items()
            if f["compile_ok"] >= best and f["invalid_to_user"] == 0
            and f["compile_p95_ms"] is not None and f["compile_p95_ms"] < 50]
    if not fits:
        return "llguidance"
    return max(fits, key=lambda e: (figures[e]["compile_ok"], -(figures[e]["mask_p50_us"] or 0)))


def main() -> None:
    global _TOKENIZER
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", help="folder or .tgz of MaskBench files (default: pinned download)")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--full", action="store_true", help="every schema")
    size.add_argument("--quick", action="store_true", help="2 schemas per split, under a minute")
    parser.add_argument("--per-split", type=int, default=100, help="schemas per split (default 100)")
    parser.add_argument("--timeout", type=float, default=10.0, help="compile limit per schema, seconds")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes")
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--save", action="store_true", help="write benchmarks/results/jsonschema.json")
    parser.add_argument("--generate", type=int, default=0, help="generate from this many relaxed schemas")
    parser.add_argument("--generate-model", choices=["random", "smollm2"], default="random",
                        help="the model that generates (smollm2: the trained instruct model, fetched once)")
    args = parser.parse_args()
    engines = [e for e in args.engines.split(",") if e]
    per_split = None if args.full else 2 if args.quick else args.per_split
    timeout_s = min(args.timeout, 3.0) if args.quick else args.timeout

    from support.models import real_tokenizer

    cases = load_cases(args.data, per_split)
    _TOKENIZER = real_tokenizer("llama-bpe")
    # Built once in the parent so that the forked workers share them and compile times
    # measure the schema alone.
    from continuous.engines.llguidance import lltokenizer
    from continuous.engines.outlines_core import vocabulary

    lltokenizer(_TOKENIZER)
    vocabulary(_TOKENIZER)
    t0 = time.perf_counter()
    results = run_all(cases, engines, args.jobs, timeout_s)
    wall = time.perf_counter() - t0
    figures = summarize(results, cases, engines)

    both = [name for name, _ in cases if all(results[(e, name)]["compiled"] for e in engines)]
    table = [("engine", "schemas", "compiled (relaxed)", "timeouts", "compile p50/p95 ms", "valid to user",
              "invalid: grammar / decoding / to user", "valid to user (both compile)", "mask p50/p99 us")]
    for e in engines:
        f = figures[e]
        va = sum(results[(e, n)]["counts"].get("valid_to_user", 0) for n in both)
        vt = sum(results[(e, n)]["counts"].get("valid_total", 0) for n in both)
        table.append((e, f["schemas"], f"{f['compile_ok']} ({f['compile_relaxed']})", f["compile_timeouts"],
                      f"{f['compile_p50_ms']} / {f['compile_p95_ms']}", f"{f['valid_to_user']}/{f['valid_total']}",
                      f"{f['invalid_grammar']} / {f['invalid_accepted']} / {f['invalid_to_user']} of "
                      f"{f['invalid_total']}", f"{va}/{vt} on {len(both)}", f"{f['mask_p50_us']} / {f['mask_p99_us']}"))
    errors = collections.Counter(results[(e, n)].get("error") for e in engines for n, _ in cases
                                 if not results[(e, n)]["compiled"])
    print(f"{len(cases)} schemas, {wall:.0f} s; most common failures:", file=sys.stderr)
    for err, n in errors.most_common(8):
        print(f"  {n:5d}  {err}", file=sys.stderr)
    result = {"default": choose_default(figures), "engines": figures,
              "sample": "all" if per_split is None else f"{per_split} per split, seed 0",
              "timeout_s": timeout_s, "wall_s": round(wall, 1)}
    if args.generate:
        relaxed = [(n, c) for n, c in cases if results.get(("llguidance", n), {}).get("counts", {}).get("relaxed")]
        result["generation"] = generation(relaxed[: args.generate], args.generate_model)
    emit("jsonschema", table, result, args.save)


def generation(cases, model_name: str = "random") -> dict:
    """Greedy JSON from each schema, at most 512 tokens.

    ``random``: a random-weight Llama of the Llama-3 tokenizer after a plain prompt.
    ``smollm2``: SmolLM2-135M-Instruct asked, in its chat template, for a document of the
    schema (its text cut at 4,000 characters). Counts the finish reasons, the values that
    validate, the calls whose value raises (cut short, or no way on within the schema), and
    the values returned without an error that fail the schema (the figure that must be 0).
    """
    import warnings

    from continuous import chat, continuous, generate, models
    from continuous.engines.schema import validator

    if model_name == "smollm2":
        from support.real import smollm2

        model = models.transformers(smollm2())

        def prompt(schema) -> str:
            ask = "Write one JSON document valid against this JSON Schema:\n" + json.dumps(schema)[:4000]
            return chat.prompt(model, [{"role": "user", "content": ask}])
    else:
        from support.models import build_arch

        model = models.transformers(*build_arch("llama", max_position_embeddings=1024))

        def prompt(schema) -> str:
            return "A JSON document:\n"
    counts = collections.Counter()
    for name, case in cases:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            state = continuous(generate.json(model, case["schema"]))(prompt(case["schema"]), max_tokens=512)
        counts[state.finish_reasons[0]] += 1
        try:
            value = state.value
        except ValueError:
            counts["raised"] += 1
            continue
        counts["valid"] += 1
        counts["invalid_returned"] += not validator(case["schema"]).is_valid(value)
    return {"schemas": len(cases), "model": model_name,
            "finish_reasons": {k: counts[k] for k in ("eos", "length", "ban_exhausted")},
            **{k: counts[k] for k in ("valid", "raised", "invalid_returned")}}

if __name__ == "__main__":
    main()
