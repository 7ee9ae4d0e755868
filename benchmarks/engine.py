"""Concurrent calls against one batched call where the host work is the step.

On the shipped toy model (4 blocks of width 256) at one torch thread, a decode step's
device work is small: what a step costs is mostly the host's (processors, masks,
sampling, the read, advancing the matchers, detokenizing, stops), as on a GPU. Here
``CLIENTS`` concurrent ``acall``s of ``TOKENS`` greedy tokens are measured against one
call holding the same prompts as a batch (one loop, one forward per step), for text and
for JSON, with:

- tokens/s of each and their ratio (``vs_one_call``);
- the host time per row per step, in µs: the wall time less the time inside the
  model's forward passes (timed by hooks on the HF module), over steps × rows;
- the model's own per-step figures where it keeps them (``model.stats``);
- whether every concurrent call's text equals the same call run alone;
- ``streams``: the same text calls as streams, read with ``async for`` and as the server
  reads them, against the batched call (``*_vs_one_call``);
- where the host time falls (``timeline_ms``, medians of the reps): before the first forward,
  between forwards, after the last one; and what each concurrent call costs more than its
  rows in the batched call (``extra_us_per_call``): once at its start, at each step, once at
  its end;
- where the host time goes (``breakdown``, µs per row per step), from one more run of each
  with timers around the host phases (the timers' own cost included, so it is measured
  apart from the figures above): the logits processors, the constraint's mask (filled on
  the host, applied on the device), sampling, the read of the ids, advancing the rows,
  detokenizing, stop strings, a forward's host work outside the model (``inputs``: masks,
  positions, caches; for a merged step, stacking the calls' inputs) and the rest (``loop``:
  the calls' loops and the engine's bookkeeping).

Run alone (other processes make the figures noise): ``python benchmarks/engine.py``.
``--device cuda`` runs it on a GPU, ``--compile`` with compiled decode steps. On a GPU a
forward is queued, not run, so "forward" counts only the host's launching of it, and the
device's own time shows up in the wall time at the reads.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import fields

import torch
from common import emit, median

from continuous import continuous, generate, models
from continuous.assets import DEMO_MODEL

CLIENTS, TOKENS = 16, 48
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                           "age": {"type": "integer"}, "tags": {"type": "array",
                                                                                "items": {"type": "string"}}},
          "required": ["name", "age", "tags"]}


class ForwardClock:
    """Seconds spent inside the HF module's forward passes (hooks around its ``forward``), and when
    each one began and ended (``spans``)."""

    def __init__(self, hf):
        self.seconds, self._start = 0.0, 0.0
        self.spans: list[tuple[float, float]] = []
        # Kept out of compiled graphs: traced, each new time would be a new constant (a recompile).
        hf.register_forward_pre_hook(torch.compiler.disable(self._enter))
        hf.register_forward_hook(torch.compiler.disable(self._exit))

    def _enter(self, *_):
        self._start = time.perf_counter()

    def _exit(self, *_):
        end = time.perf_counter()
        self.seconds += end - self._start
        self.spans.append((self._start, end))


class Phases:
    """Host seconds per phase, from timers put around the library's functions while it is
    used (``with Phases(model) as phases``): a phase's time excludes the phases it calls."""

    def __init__(self, model):
        from continuous.decode import advance, constraints, draw, processors, rows
        from continuous.detok import Detokenizer

        self.model = model
        self.targets = [  # (owner, attribute, phase)
            (processors.Constrained, "__call__", "mask"), (constraints.RowConstraints, "_refresh", "mask"),
            (constraints.RowConstraints, "refresh_all", "mask"), (advance.Advance, "consume", "advance"),
            (processors.Forced, "__call__", "processors"), (processors.Banned, "__call__", "processors"),
            (processors.Finished, "__call__", "processors"), (processors, "run", "processors"),
            (draw, "choose", "sample"), (draw, "to_host", "read"), (advance.Advance, "__call__", "advance"),
            (Detokenizer, "step", "detokenize"), (rows.StopStrings, "find", "stops"),
            (type(model), "_run_joint", "inputs"), (type(model), "_run_one", "inputs"),
        ]
        self.seconds: dict[str, float] = {}
        self._stack: list[float] = []  # per open phase, the seconds of the phases nested in it

    def _wrap(self, fn, phase: str):
        def timed(*args, **kwargs):
            self._stack.append(0.0)
            began = time.perf_counter()
            try:
                out = fn(*args, **kwargs)
                if phase == "read" and callable(out):  # to_host: the wait is in the function it returns
                    out = self._wrap(out, "read")
                return out
            finally:
                spent = time.perf_counter() - began
                nested = self._stack.pop()
                self.seconds[phase] = self.seconds.get(phase, 0.0) + spent - nested
                if self._stack:
                    self._stack[-1] += spent
        return timed

    def __enter__(self):
        self._saved = [(owner, name, getattr(owner, name)) for owner, name, _ in self.targets]
        for (owner, name, phase), (_, _, fn) in zip(self.targets, self._saved):
            setattr(owner, name, self._wrap(fn, phase))
        # The engine holds the backend's bound methods: it must see the timed ones.
        engine = self.model.engine
        self._engine = engine.run_one, engine.run_joint
        engine.run_one, engine.run_joint = self.model._run_one, self.model._run_joint
        return self

    def __exit__(self, *exc):
        for owner, name, fn in self._saved:
            setattr(owner, name, fn)
        self.model.engine.run_one, self.model.engine.run_joint = self._engine


def prompts(n: int) -> list[str]:
    return [f"User: Tell me about the number {i} and the city number {3 * i + 1}.\nAssistant:" for i in range(n)]


def measure(model, clock: ForwardClock, run) -> dict:
    """Wall seconds, forward seconds and forward calls of ``run()``, where its host time fell
    (:func:`timeline`); its result."""
    model.stats.reset()
    forward, began, first = clock.seconds, time.perf_counter(), len(clock.spans)
    out = run()
    ended = time.perf_counter()
    wall, forward = ended - began, clock.seconds - forward
    per_step = {f.name: getattr(model.stats, f.name) for f in fields(model.stats)
                if not f.name.startswith("_") and f.name not in ("tokens_drafted", "tokens_accepted")}
    return {"out": out, "wall": wall, "forward": forward, "steps": model.stats.forward_calls, "stats": per_step,
            "timeline": timeline(clock.spans[first:], began, ended)}


def timeline(spans: list[tuple[float, float]], began: float, ended: float) -> dict:
    """Where a run's host time fell, in ms: before its first forward (``start``: tokenizing,
    submitting, preparing the calls), between two forwards (``steps``, summed; ``step``, the
    median), and after its last one (``end``: the results, the states and their caches)."""
    gaps = [b[0] - a[1] for a, b in zip(spans, spans[1:])]
    return {"start": round(1e3 * (spans[0][0] - began), 2), "steps": round(1e3 * sum(gaps), 2),
            "step": round(1e3 * median(gaps), 3) if gaps else 0.0, "end": round(1e3 * (ended - spans[-1][1]), 2)}


def _generated(run: dict) -> int:
    """The tokens a measured run generated (one log-probability a token)."""
    out = run["out"]
    states = out if isinstance(out, list) else [out]
    return sum(len(row) for s in states for row in s.logprobs)


def one_kind(model, clock, gen, texts_in: list[str], tokens: int, reps: int) -> dict:
    """The batched call and the concurrent calls of one generator, ``reps`` times each, in turn (medians)."""
    def batched():
        return gen(texts_in, max_tokens=tokens, logprobs=0)

    async def together():
        return await asyncio.gather(*[gen.acall(p, max_tokens=tokens, logprobs=0) for p in texts_in])

    gen(texts_in, max_tokens=tokens)  # warm up (compiles the batched shapes of a compiled model)
    asyncio.run(together())
    result = {}
    kinds = (("one_call", batched), ("concurrent", lambda: asyncio.run(together())))
    # The two alternate, rep by rep, so that a drift of the machine's speed falls on both.
    paired = [[measure(model, clock, run) for _, run in kinds] for _ in range(reps)]
    for i, (name, _) in enumerate(kinds):
        runs = [pair[i] for pair in paired]
        best = sorted(runs, key=lambda r: r["wall"])[len(runs) // 2]
        out = best["out"]
        values = [str(s) for s in out] if name == "concurrent" else list(out)
        generated = _generated(best)
        host = best["wall"] - best["forward"]
        result[name] = {"tok_s": round(generated / best["wall"], 1),
                        "ms_per_step": round(1e3 * best["wall"] / max(best["steps"], 1), 2),
                        "forward_ms_per_step": round(1e3 * best["forward"] / max(best["steps"], 1), 2),
                        "host_us_per_row_step": round(1e6 * host / max(best["steps"], 1) / len(texts_in), 1),
                        "steps": best["steps"], "tokens": generated, "stats": best["stats"], "values": values,
                        "timeline_ms": {k: round(median([r["timeline"][k] for r in runs]), 3) for k in best["timeline"]}}
    for name, run in (("one_call", batched), ("concurrent", lambda: asyncio.run(together()))):
        with Phases(model) as phases:
            timed = measure(model, clock, run)
        host = dict(phases.seconds)
        host["inputs"] = host.get("inputs", 0.0) - timed["forward"]  # the model's own forward is not host work
        host["loop"] = timed["wall"] - timed["forward"] - sum(host.values())
        per = 1e6 / max(timed["steps"], 1) / len(texts_in)
        result[name]["breakdown"] = {k: round(v * per, 1) for k, v in sorted(host.items())}
    alone = [str(gen(p, max_tokens=tokens)) for p in texts_in]
    result["identical_to_alone"] = result["concurrent"].pop("values") == alone
    result["one_call_identical_to_alone"] = result["one_call"].pop("values") == alone
    # What each concurrent call costs more than its rows in the batched call: once at the start
    # and at the end, and at each step (the host gaps between forwards, per call and step).
    one, conc = result["one_call"]["timeline_ms"], result["concurrent"]["timeline_ms"]
    n, steps = len(texts_in), max(result["concurrent"]["steps"] - 1, 1)
    result["extra_us_per_call"] = {"start": round(1e3 * (conc["start"] - one["start"]) / n, 1),
                                   "step": round(1e3 * (conc["steps"] - one["steps"]) / n / steps, 1),
                                   "end": round(1e3 * (conc["end"] - one["end"]) / n, 1)}
    # The median of each rep's ratio.
    result["vs_one_call"] = round(median([(_generated(conc) / conc["wall"]) / (_generated(one) / one["wall"])
                                          for one, conc in paired]), 3)
    return result


def streams(gen, texts_in: list[str], tokens: int, reps: int) -> dict:
    """``CLIENTS`` concurrent streams of text against the batched call, in turn, rep by rep: read with
    ``async for`` (which keeps, at each step, the state its consumer has seen, for a cancel), and
    as the server reads them (no such snapshot); each one's medians of its reps' ratios."""
    async def read(prompt, server):
        stream = gen.astream(prompt, max_tokens=tokens)
        return "".join([piece async for piece in (stream._no_snapshots() if server else stream)])

    def timed(run):
        began = time.perf_counter()
        out = run()
        return time.perf_counter() - began, out

    def concurrent(server):
        async def together():
            return await asyncio.gather(*[read(p, server) for p in texts_in])
        return lambda: asyncio.run(together())

    batched = lambda: gen(texts_in, max_tokens=tokens)  # noqa: E731
    concurrent(False)()
    ratios = {"async_for": [], "server": []}
    texts = {}
    for _ in range(reps):
        one, _ = timed(batched)
        for name, server in (("async_for", False), ("server", True)):
            wall, texts[name] = timed(concurrent(server))
            ratios[name].append(one / wall)  # the same tokens: the ratio of the walls
    alone = [str(gen(p, max_tokens=tokens))[len(p):] for p in texts_in]
    return {**{f"{k}_vs_one_call": round(median(v), 3) for k, v in ratios.items()},
            "identical_to_alone": all(t == alone for t in texts.values())}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="4 clients, 8 tokens, one rep")
    parser.add_argument("--save", action="store_true", help="write benchmarks/results/engine.json")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    parser.add_argument("--compile", action="store_true", help="compiled decode steps (CUDA graphs on a GPU)")
    return parser.parse_args()


def main():
    global CLIENTS, TOKENS
    args = parse_args()
    if args.quick:
        CLIENTS, TOKENS, args.reps = 4, 8, 1
    torch.set_num_threads(args.threads)
    model = models.transformers(str(DEMO_MODEL), dtype="float32", device=args.device, compile=args.compile)
    clock = ForwardClock(model.model)
    texts_in = prompts(CLIENTS)
    kinds = {"text": continuous(generate.text(model)), "json": continuous(generate.json(model, SCHEMA))}
    results = {k: one_kind(model, clock, gen, texts_in, TOKENS, args.reps) for k, gen in kinds.items()}
    streamed = streams(kinds["text"], texts_in, TOKENS, args.reps)
    table = [("kind", "one call tok/s", "concurrent tok/s", "vs one call", "host µs/row/step (one, conc.)",
              "forward ms/step (one, conc.)", "identical")]
    for k, r in results.items():
        one, conc = r["one_call"], r["concurrent"]
        table.append((k, one["tok_s"], conc["tok_s"], r["vs_one_call"],
                      f"{one['host_us_per_row_step']}, {conc['host_us_per_row_step']}",
                      f"{one['forward_ms_per_step']}, {conc['forward_ms_per_step']}", r["identical_to_alone"]))
    phases = sorted({k for r in results.values() for run in ("one_call", "concurrent") for k in r[run]["breakdown"]})
    for part in (phases[:5], phases[5:]):  # µs per row per step of each phase, one call and concurrent
        table.append(("host µs/row/step", "(one, conc.)", *part) + ("",) * (5 - len(part)))
        for k, r in results.items():
            cells = [f"{r['one_call']['breakdown'].get(p, 0.0)}, {r['concurrent']['breakdown'].get(p, 0.0)}"
                     for p in part]
            table.append((k, "", *cells) + ("",) * (5 - len(part)))
    table.append(("extra µs per call", "start", "each step", "end", "", "", ""))
    for k, r in results.items():
        extra = r["extra_us_per_call"]
        table.append((k, extra["start"], extra["step"], extra["end"], "", "", ""))
    table.append(("streams (text)", "async for vs one call", streamed["async_for_vs_one_call"],
                  "as the server reads them", streamed["server_vs_one_call"], "identical",
                  streamed["identical_to_alone"]))
    emit("engine", table, {"bench": "engine", "clients": CLIENTS, "tokens": TOKENS, "threads": args.threads,
                           "device": args.device, "compile": args.compile,
                           "kinds": results, "streams": streamed}, args.save)


if __name__ == "__main__":
    main()
