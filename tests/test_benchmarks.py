"""Smoke test of the benchmarks: each runs in --quick mode and prints its JSON line.

Times are never asserted (machines here are shared and noisy); token counts are exact,
so the bars that are counts are checked.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"

KEYS = {
    "multiturn": {"tokens": {"continuous", "ideal", "outlines"}, "seconds": {"continuous", "ideal", "outlines"}},
    "constraint": {"ms_per_token": {"unconstrained", "json", "outlines_json"}, "build_ms": {"cold", "warm"}},
    "stateops": {"ops": None},
    "fork": {"tokens": {"continuous", "expected"}, "seconds": {"continuous", "outlines"}},
    "floor": {"ms_per_token": None, "floor_ms_per_token": None},
    "decode": {"ms_per_token": {"100", "1000"}},
    "swarm": {"identical": None, "ms_per_token": {"local", "remote"}, "failover": {"identical", "recovery_s"}},
}


def run(name):
    proc = subprocess.run([sys.executable, str(BENCH / f"{name}.py"), "--quick", "--reps", "1"],
                          cwd=BENCH, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["bench"] == name
    for key, sub in KEYS[name].items():
        assert key in result
        if sub:
            assert sub <= set(result[key])
    return result


@pytest.mark.parametrize("name", ["constraint", "floor", "decode"])
def test_benchmark_prints_its_figures(name):
    run(name)


def test_multiturn_forwards_exactly_what_the_ideal_loop_does():
    result = run("multiturn")
    assert result["tokens"]["continuous"] == result["tokens"]["ideal"]
    assert result["tokens"]["outlines"] > result["tokens"]["ideal"]


def test_stateops_stay_within_their_bounds():
    ops = run("stateops")["ops"]
    assert {op["op"] for op in ops} == {"slice", "append", "sum"}
    for op in ops:
        assert set(op) >= {"op", "tokens_forwarded", "bound", "seconds", "seconds_recompute"}
        assert op["tokens_forwarded"] <= op["bound"], op


def test_fork_forwards_the_prompt_once():
    result = run("fork")
    assert result["tokens"]["continuous"] <= result["tokens"]["expected"]


def test_swarm_decodes_and_fails_over_identically():
    result = run("swarm")
    assert result["identical"] is True
    assert result["failover"]["identical"] is True
