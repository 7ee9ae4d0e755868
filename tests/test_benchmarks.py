"""Smoke test of the benchmarks: each runs in --quick mode and prints its JSON line.

Times are never asserted (machines here are shared and noisy); token counts are exact,
so the bars that are counts are checked. The smoke runs are marked ``bench`` (``make
test-bench`` runs them): each subprocess has a time limit shorter than its test's, so a run
that overstays fails with the benchmark's name, not with pytest's timeout.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.extras import need

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"

KEYS = {
    "multiturn": {"tokens": {"continuous", "ideal", "outlines"}, "seconds": {"continuous", "ideal", "outlines"}},
    "constraint": {"ms_per_token": {"unconstrained", "json", "outlines_json"}, "build_ms": {"cold", "warm"}},
    "stateops": {"ops": None},
    "fork": {"tokens": {"continuous", "outlines", "expected"}, "seconds": {"continuous", "outlines"}},
    "floor": {"ms_per_token": None, "floor_ms_per_token": None, "gemv_sweep_ms": None},
    "decode": {"ms_per_token": {"100", "1000"}},
    "swarm": {"identical": None, "ms_per_token": {"local", "remote"}, "failover": {"identical", "recovery_s"}},
    "real": {"multiturn": None, "json": {"ms_per_output_token", "forward_calls", "correct_fields"}},
    "backtrack": {"tokens": {"continuous", "regenerate", "crop"}, "banned_found": None},
    "fastforward": {"ms_per_output_token": {"free", "json", "json_ff"}, "forward_calls": {"json", "json_ff"}},
    "speculative": {"ms_per_output_token": {"token", "ff", "lookup_ff", "hf", "hf_lookup"},
                    "forwards_per_output_token": {"token", "ff", "lookup_ff", "hf", "hf_lookup"}},
    "serve": {"models": {"small"}},
    "llamacpp": {"f32": {"decode", "chat", "json", "concurrent", "memory_mb"}, "q4_1": {"decode", "memory_mb"}},
    "draw": {"ms_per_step": {"2048", "49152"}},
    "engine": {"kinds": {"text", "json"},
               "streams": {"async_for_vs_one_call", "server_vs_one_call", "identical_to_alone"}},
}


#: Seconds a benchmark's smoke run may take by default; its test gets a minute more.
RUN_S = 540


def bench(limit: int = RUN_S):
    """Marks a smoke run of ``limit`` seconds: ``bench``, with pytest's timeout a minute past the run's."""
    def mark(test):
        return pytest.mark.bench(pytest.mark.timeout(limit + 60)(test))
    return mark


def output(command: list[str], limit: int = RUN_S) -> dict:
    """The JSON line a benchmark prints last; it fails, naming the benchmark, past ``limit`` seconds."""
    try:
        proc = subprocess.run(command, cwd=BENCH, capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stderr or b"").decode(errors="replace")[-2000:]
        pytest.fail(f"{Path(command[1]).name} ran past its {limit} s; its last output:\n{tail}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(name, *args, limit=RUN_S):
    """``benchmarks/NAME.py --quick --reps 1``'s figures, its keys checked against :data:`KEYS`."""
    result = output([sys.executable, str(BENCH / f"{name}.py"), "--quick", "--reps", "1", *args], limit)
    assert result["bench"] == name
    for key, keys in KEYS[name].items():
        assert key in result
        if keys and name == "swarm":  # the swarm benchmark reports more figures than these
            assert keys <= set(result[key])
        elif keys:
            assert set(result[key]) == keys, (key, sorted(result[key]))
    return result


@pytest.mark.parametrize("name", ["constraint", "floor", "decode"])
@bench()
def test_benchmark_prints_its_figures(name):
    run(name)


@bench()
def test_draw_benchmark_times_every_kind_of_step_for_both_ways():
    for figures in run("draw")["ms_per_step"].values():
        assert set(figures) == {"greedy", "sample", "top_p", "mask"}
        assert all(f["library"] > 0 and f["transformers"] > 0 for f in figures.values())


@bench()
def test_engine_benchmark_s_concurrent_calls_equal_each_call_alone():
    """Concurrent calls and one batched call give each call's own text, and every figure is there."""
    result = run("engine")
    assert result["streams"]["identical_to_alone"]  # streamed, each as the call alone
    for kind in result["kinds"].values():
        assert kind["identical_to_alone"] and kind["one_call_identical_to_alone"]
        for how in ("one_call", "concurrent"):
            figures = kind[how]
            assert figures["tokens"] > 0 and figures["steps"] > 0 and figures["host_us_per_row_step"] > 0
            assert figures["stats"]["steps"] > 0  # the engine's own per-step counters
            phases = figures["breakdown"]  # where the host time went, µs per row per step
            assert {"advance", "detokenize", "sample", "read", "inputs", "loop"} <= set(phases)
            assert all(v >= 0 for k, v in phases.items() if k != "loop")
            spent = figures["timeline_ms"]  # host time before, between and after the forwards
            assert set(spent) == {"start", "steps", "step", "end"} and all(v >= 0 for v in spent.values())
            assert spent["step"] <= spent["steps"] or figures["steps"] == 1
        assert set(kind["extra_us_per_call"]) == {"start", "step", "end"}


@bench()
def test_multiturn_forwards_exactly_what_the_ideal_loop_does():
    result = run("multiturn")
    assert result["tokens"]["continuous"] == result["tokens"]["ideal"]
    assert result["tokens"]["outlines"] > result["tokens"]["ideal"]


@bench()
def test_stateops_forward_exactly_what_the_operations_leave_uncached():
    ops = run("stateops")["ops"]
    assert {op["op"] for op in ops} == {"slice", "append", "sum"}
    for op in ops:
        assert set(op) == {"op", "tokens_forwarded", "expected", "bound", "same_every_rep", "seconds",
                           "seconds_recompute"}
        # ``expected`` comes from the token ids alone, not from the library's accounting.
        assert op["tokens_forwarded"] == op["expected"], op
        assert op["same_every_rep"], op
        assert op["expected"] <= op["bound"], op  # the bound on re-tokenization at a cut


@bench()
def test_backtrack_outputs_hold_no_banned_phrase_and_rewinds_forward_least():
    result = run("backtrack")
    assert result["banned_found"] == 0
    assert result["tokens"]["regenerate"] > result["tokens"]["continuous"]


@bench()
def test_fastforward_makes_fewer_forward_calls_for_the_same_tokens():
    calls = run("fastforward")["forward_calls"]
    assert calls["json_ff"] < calls["json"]


@bench()
def test_fork_forwards_the_prompt_once():
    result = run("fork")
    assert result["tokens"]["continuous"] <= result["tokens"]["expected"]


@bench()
def test_swarm_decodes_and_fails_over_identically():
    result = run("swarm")
    assert result["identical"] is True
    assert result["failover"]["identical"] is True


@pytest.mark.parametrize("tied", [False, True])
def test_floor_counts_the_weights_a_step_reads(tied):
    # A step reads one row of the input embedding, not the table,
    # unless the table is the LM head too.
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(BENCH))
    try:
        from floor import step_weight_bytes
    finally:
        sys.path.remove(str(BENCH))
    vocab, h, ffn, layers, head_dim, kv_heads = 500, 32, 64, 2, 8, 2
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=h, intermediate_size=ffn,
                                      num_hidden_layers=layers, num_attention_heads=h // head_dim,
                                      num_key_value_heads=kv_heads, tie_word_embeddings=tied))
    # Counted from the config, not from the model: q and o, k and v (grouped), the MLP,
    # two norms per block; the final norm; the LM head.
    block = 2 * h * h + 2 * h * kv_heads * head_dim + 3 * h * ffn + 2 * h
    read = layers * block + h + vocab * h
    if not tied:
        read += h  # the one embedding row a token looks up
    assert step_weight_bytes(hf) == 4 * read  # fp32


def test_cpu_benchmark_reports_a_sweep_this_cpu_cannot_run_as_unavailable(monkeypatch):
    """On a CPU without oneDNN's bf16 packing (AVX2 only), the packed bf16 sweep is left out
    with the reason, and every other sweep still reports."""
    sys.path.insert(0, str(BENCH))
    try:
        import cpu
    finally:
        sys.path.remove(str(BENCH))
    monkeypatch.setattr(cpu, "bf16_packing", lambda: "no avx512bw here")
    monkeypatch.setattr(cpu, "packed_sweep", lambda w: 1e-3 if w[0].dtype == cpu.torch.float32 else 1 / 0)
    monkeypatch.setattr(cpu, "gemv_sweep", lambda hf: 2e-3)
    out = cpu.gemv({"model": "small", "full": True})
    assert out["unavailable"] == {"bf16_packed": "no avx512bw here"}
    assert set(out) == {"fp32", "bf16", "fp32_packed", "fp32_no_mkldnn", "bf16_no_mkldnn", "bytes", "unavailable"}


@bench(900)
def test_gpu_benchmark_runs_on_the_cpu():
    """The GPU workload's smoke run (a small shape on the CPU): every section and figure present."""
    result = output([sys.executable, str(BENCH / "gpu.py"), "--device", "cpu", "--quick", "--reps", "1"], 900)
    assert result["bench"] == "gpu" and result["device"] == "cpu"
    assert set(result["decode_ms"]) == {"continuous", "continuous_compiled", "hf_dynamic", "hf_static", "floor"}
    assert all(v > 0 for k, v in result["decode_ms"].items() if k != "hf_static")  # HF's static cache needs CUDA
    assert set(result["multiturn_s"]) == {"continuous", "continuous_compiled", "ideal", "outlines"}
    assert set(result["constraint_ms"]) == {"free", "json", "json_ff", "free_compiled", "json_compiled", "json_ff_compiled"}
    assert result["long"]["tokens"] >= 500 and set(result["long"]["seconds"]) == {"continuous", "hf"}
    assert set(result["fork_s"]) == {"continuous", "hf"}
    assert all(v > 0 for section in ("multiturn_s", "constraint_ms", "fork_s") for v in result[section].values())


@pytest.mark.real
@bench()
def test_real_model_chat_forwards_what_the_ideal_loop_does_and_extracts_right():
    result = run("real")
    chat, extraction = result["multiturn"], result["json"]
    assert chat["tokens"]["continuous"] == chat["tokens"]["ideal"] and chat["same_answers_as_ideal"]
    assert extraction["correct_fields"] == "9/9"
    assert extraction["forward_calls"]["json_ff"] < extraction["forward_calls"]["json"]


@pytest.mark.real
@bench()
def test_speculative_extraction_keeps_the_outputs_and_drafts_from_the_message():
    result = run("speculative")
    assert result["same_outputs"]
    assert result["drafted"] >= result["accepted"] > 0
    calls = result["forwards_per_output_token"]
    assert calls["lookup_ff"] < calls["ff"] < calls["token"]


@bench()
def test_jsonschema_counts_what_reaches_the_user(tmp_path):
    """Three MaskBench-shaped cases: the default path relaxes one schema, catches its invalid
    instance while decoding, and takes valid instances written in any member order."""
    cases = {
        "Plain---a.json": {"schema": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}},
                           "tests": [{"data": {"b": "x", "a": 1}, "valid": True},
                                     {"data": {"a": "x"}, "valid": False}]},
        "Relaxed---b.json": {"schema": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
                             "tests": [{"data": [1, 2], "valid": True}, {"data": [1, 1], "valid": False}]},
        "Relaxed---c.json": {"schema": {"type": "string", "not": {"const": "no"}},
                             "tests": [{"data": "yes", "valid": True}, {"data": "no", "valid": False}]},
    }
    for name, case in cases.items():
        (tmp_path / name).write_text(json.dumps(case))
    result = output([sys.executable, str(BENCH / "jsonschema.py"), "--data", str(tmp_path), "--engines",
                     "llguidance", "--full", "--generate", "2"])
    f = result["engines"]["llguidance"]
    assert (f["compile_ok"], f["compile_relaxed"]) == (3, 2)
    assert f["valid_to_user"] == f["valid_total"] == 3 and f["valid_as_written"] == 2  # {"b", "a"}: schema order
    assert f["invalid_grammar"] == 2 and f["invalid_accepted"] == 0 and f["invalid_to_user"] == 0
    assert result["generation"]["schemas"] == 2 and result["generation"]["invalid_returned"] == 0


@bench()
def test_serve_prefills_only_what_no_earlier_state_holds():
    result = run("serve")["models"]["small"]
    chat = result["library"]["chat"]
    assert chat["cache_on"]["prompt_tokens_forwarded"] == chat["cache_on"]["ideal"]
    assert chat["cache_off"]["prompt_tokens_forwarded"] > chat["cache_on"]["prompt_tokens_forwarded"]
    turns = result["server"]["chat"]["cache_on"]["turns"]
    # From the second turn on, the server reports at least the last turn's prompt as cached.
    assert all(t["cached"] >= prev["prompt"] for prev, t in zip(turns, turns[1:]))


@bench(1500)  # a fresh process per figure, and five compiled variants
def test_cpu_benchmark_runs_every_variant_and_sweep():
    """The CPU step's smoke run: each variant decodes (compiled ones, with frozen weights and
    inductor's GEMM templates too), fp32 ones give eager's tokens, and every sweep reports."""
    result = output([sys.executable, str(BENCH / "cpu.py"), "--quick", "--reps", "1"], 1500)
    assert result["bench"] == "cpu" and set(result["models"]) == {"small"}
    figures = result["models"]["small"]["1"]
    fp32 = {"compiled", "frozen", "autotune", "autotune_frozen"}
    # A bf16 variant this CPU has no kernel for is skipped with torch's reason; the rest decode.
    bf16 = {"bf16", "bf16_no_mkldnn", "bf16_frozen"}
    assert set(figures["ms_per_token"]) | (set(figures["skipped"]) & bf16) == {"eager", "hf"} | bf16 | fp32
    assert all(ms > 0 for ms in figures["ms_per_token"].values())
    # The test model's tokenizer is one llama.cpp's converter does not know: skipped, with the reason.
    assert set(figures["skipped"]) <= {"llamacpp", "llamacpp_f32"} | bf16 and all(figures["skipped"].values())
    assert all(figures["same_as_eager"][k] for k in fp32 | {"hf"})
    # oneDNN's bf16 packing needs AVX-512 (or avx_ne_convert): elsewhere that sweep is unavailable, with why.
    sweeps = {"fp32", "bf16", "fp32_packed", "bf16_packed", "fp32_no_mkldnn", "bf16_no_mkldnn"}
    assert set(figures["gemv"]) | set(figures["gemv_unavailable"]) == sweeps
    assert set(figures["gemv_unavailable"]) <= {"bf16_packed"} and all(figures["gemv_unavailable"].values())
    assert all(g["ms"] > 0 and g["gb_s"] > 0 for g in figures["gemv"].values())
    assert "default" in figures["gemv_env"] and len(figures["gemv_env"]) > 1


@pytest.mark.real
@bench(1100)
def test_cpu_benchmark_runs_llamacpp_on_the_same_weights():
    """With llama-server built: the same greedy tokens from the F32 GGUF of SmolLM2's weights."""
    from support.llamacpp import llama_server

    if llama_server() is None:
        pytest.skip("llama-server is not built (python tests/support/llamacpp.py server)")
    figures = output([sys.executable, str(BENCH / "cpu.py"), "--quick", "--reps", "1", "--models", "smollm2",
                      "--only", "llamacpp"], 1100)["models"]["smollm2"]["1"]
    assert set(figures["ms_per_token"]) == {"eager", "llamacpp_f32", "llamacpp_q4_1"} and not figures["skipped"]
    assert figures["same_as_eager"]["llamacpp_f32"]


@pytest.mark.real
@bench()
def test_llamacpp_gives_the_servers_greedy_outputs_and_prefills_no_more_of_the_chat():
    need("llama_cpp", "llamacpp")
    from support.llamacpp import llama_server

    if llama_server() is None:
        pytest.skip("llama-server is not built: python tests/support/llamacpp.py server")
    result = run("llamacpp")
    f32 = result["f32"]
    assert result["server"] and all(row["same"] for row in f32["decode"].values())
    chat = f32["chat"]
    # The same template on both sides: the same prompts, and the same greedy answers at F32.
    assert chat["prompt_tokens_per_turn"]["ours"] == chat["prompt_tokens_per_turn"]["server"] and chat["same"]
    ours, server = chat["prefilled_per_turn"]["ours"], chat["prefilled_per_turn"]["server"]
    assert ours[0] == server[0] == chat["prompt_tokens_per_turn"]["ours"][0]  # the first turn: its whole prompt
    assert all(0 < a <= b for a, b in zip(ours[1:], server[1:]))  # then: never more than the server re-prefills
    assert f32["json"]["same_values"] and f32["concurrent"]["same"]
    assert all(v > 0 for section in (f32, result["q4_1"]) for v in section["memory_mb"].values())
