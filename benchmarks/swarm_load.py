"""The swarm under load, faults and hostile input, on 127.0.0.1.

- load: 16 concurrent greedy clients x 64 tokens through 2 servers (2 spans), against one
  client alone (medians of 5 interleaved repetitions); every output must equal
  transformers' greedy generate on the same model (run before any server starts, so that
  it does not compete for the cores);
- chaos: the same load with a spare per span, while a server is killed every 10 s and a
  replacement started; every output identical, and no cache left in use afterwards;
- fuzz: 5,000 malformed frames from a hostile peer (its own daemon) to one server while
  clients run: every frame answered or closed, the server up, the clients' outputs intact.

Beside the throughput it reports how many cores the processes kept busy (all of them:
client, servers, libp2p daemons) and their CPU time per token: on 2 cores, 16 clients
cannot go faster than 2 / (CPU seconds per token). The 16 clients are threads of one
process, whose heads share one product per burst (``RowBatcher``); each repetition also
runs them with every head computed alone, as clients in separate processes would: what
the servers' batching gives by itself.

    python benchmarks/swarm_load.py [--quick] [--save]
"""

from __future__ import annotations

import os
import statistics
import tempfile
import threading

import torch
from common import emit, parse_args, random_text, reference_model
from hivemind.p2p import PeerID
from support.stress import Chaos, budget_in_use, fuzz, greedy_clients

from continuous.demo.swarm import Swarm
from continuous.remote.client.bridge import DistributedModelForCausalLM
from continuous.remote.client.routing import SwarmClient
from continuous.remote.wire.protocol import default_dht_prefix

CACHE_BYTES = 2**30
REPEATS = 5


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3


def cpu_seconds(pid: int = None) -> float:
    """CPU seconds used so far by ``pid`` (this process by default) and its live descendants
    (the servers and every libp2p daemon), from /proc: what bounds throughput on 2 cores."""
    pid = os.getpid() if pid is None else pid
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:  # the process is gone
        return 0.0
    total = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    for task in tasks:
        try:
            children = open(f"/proc/{pid}/task/{task}/children").read().split()
        except OSError:  # a thread that ended meanwhile: the process's own figure still counts
            continue
        total += sum(cpu_seconds(int(child)) for child in children)
    return total


def main():
    args = parse_args(__doc__)
    size = "small" if args.quick else "mid"
    hf, tok, path = reference_model(size)
    torch.set_num_threads(1)  # the client's threads and the servers share the cores
    clients, n = 16, (16 if args.quick else 64)
    frames = 500 if args.quick else 5000
    period = 2.0 if args.quick else 10.0
    prompts = [torch.tensor([tok(random_text(tok, 16 + 3 * i, seed=100 + i)).input_ids]) for i in range(clients)]
    # The reference first, alone on the machine.
    with torch.inference_mode():
        expected = [hf.generate(p, max_new_tokens=n, do_sample=False, min_new_tokens=n)[:, p.shape[1]:]
                    for p in prompts]
    layers = hf.config.num_hidden_layers
    spans = f"0:{layers // 2}", f"{layers // 2}:{layers}"

    def same(outs, idx=None):
        idx = range(len(outs)) if idx is None else idx
        return all(o is not None and torch.equal(o, expected[i]) for o, i in zip(outs, idx))

    with tempfile.TemporaryDirectory() as logs, Swarm(path, logs, cache_bytes=CACHE_BYTES, max_length=1024,
                                                     session_timeout=60) as swarm:
        swarm.start(*spans)
        model = DistributedModelForCausalLM.from_pretrained(path, initial_peers=swarm.maddrs, step_timeout=60.0,
                                                            max_retries=6)
        try:
            greedy_clients(model, prompts[:1], 2)  # warm the connections
            # Medians of REPEATS interleaved repetitions, as in the other benchmarks: a run of
            # a few seconds on a shared machine moves with whatever else runs.
            runs1, runs16, lat1, lat16, steps, forwards, identical = [], [], [], [], 0, 0, True
            runs16_alone = []
            busy = {"1": [], "16": []}  # cores busy during the load, and CPU ms per token
            for _ in range(REPEATS):
                c0 = cpu_seconds()
                one, lat, t1 = greedy_clients(model, prompts[:1], n)
                c1 = cpu_seconds()
                runs1.append(n / t1)
                lat1 += lat
                model._head_batcher, batcher = model._logits, model._head_batcher  # each head alone
                try:
                    alone, _, t_alone = greedy_clients(model, prompts, n)
                finally:
                    model._head_batcher = batcher
                runs16_alone.append(clients * n / t_alone)
                identical = identical and same(alone)
                before = [model.swarm.info(PeerID.from_base58(s.peer_id)) for s in swarm.servers]
                c2 = cpu_seconds()
                many, lat, t16 = greedy_clients(model, prompts, n)
                c3 = cpu_seconds()
                after = [model.swarm.info(PeerID.from_base58(s.peer_id)) for s in swarm.servers]
                busy["1"].append(((c1 - c0) / t1, 1e3 * (c1 - c0) / n))
                busy["16"].append(((c3 - c2) / t16, 1e3 * (c3 - c2) / (clients * n)))
                runs16.append(clients * n / t16)
                lat16 += lat
                # Steps per forward on the servers during the 16-client load: the batching at work.
                steps += sum(a["steps"] - b["steps"] for a, b in zip(after, before))
                forwards += sum(a["forwards"] - b["forwards"] for a, b in zip(after, before))
                identical = identical and same(one) and same(many)
            steps_per_forward = steps / max(1, forwards)
            tps = {"1": statistics.median(runs1), "16": statistics.median(runs16),
                   "16_head_alone": statistics.median(runs16_alone)}
            cores = {k: round(statistics.median(u for u, _ in v), 2) for k, v in busy.items()}
            cpu_ms = {k: round(statistics.median(c for _, c in v), 1) for k, v in busy.items()}

            # Fuzz under load: a hostile peer with its own daemon, while the clients decode.
            target = swarm.servers[0]
            hostile = SwarmClient(swarm.maddrs, default_dht_prefix(path), layers)
            fuzzed = {}
            fuzzer = threading.Thread(target=lambda: fuzzed.update(fuzz(
                hostile, PeerID.from_base58(target.peer_id), frames, hf.config.hidden_size, 0, layers // 2)))
            fuzzer.start()
            during, _, _ = greedy_clients(model, prompts[:4], n)
            fuzzer.join()
            hostile.shutdown()
            fuzz_result = {"frames": fuzzed["frames"], "answered_or_closed": fuzzed["answered_or_closed"],
                           "server_up": target.alive(), "sessions_intact": same(during)}

            # Chaos: a spare per span, a server killed every `period` seconds.
            swarm.start(*spans)
            outs, idx = [], []
            with Chaos(swarm, period) as chaos:
                # Rounds of the load until servers have died under it (a round may be shorter
                # than the period); every session of every round counts.
                for _ in range(6):
                    round_outs, _, _ = greedy_clients(model, prompts, n)
                    outs += round_outs
                    idx += range(clients)
                    if len(chaos.killed) >= 2:
                        break
            live = [PeerID.from_base58(s.peer_id) for s in swarm.servers if s.alive()]
            chaos_result = {"sessions": len(outs), "completed": sum(o is not None for o in outs),
                            "identical": same(outs, idx),
                            "budget_in_use_after": budget_in_use(model.swarm, live, CACHE_BYTES),
                            "killed": len(chaos.killed)}
            used_after_load = chaos_result["budget_in_use_after"]
        finally:
            model.shutdown()
    p99 = {"1": round(pct(lat1, 0.99), 1), "16": round(pct(lat16, 0.99), 1)}
    p50 = {"1": round(pct(lat1, 0.5), 1), "16": round(pct(lat16, 0.5), 1)}
    table = [("", "1 client", f"{clients} clients"),
             ("tokens/s", f"{tps['1']:.1f}", f"{tps['16']:.1f}"),
             ("p50 step ms", p50["1"], p50["16"]), ("p99 step ms", p99["1"], p99["16"]),
             ("speedup", "", f"{tps['16'] / tps['1']:.2f}x"),
             ("16 clients, each head alone: tokens/s, speedup", "",
              f"{tps['16_head_alone']:.1f}, {tps['16_head_alone'] / tps['1']:.2f}x"),
             ("cores busy", cores["1"], cores["16"]), ("CPU ms per token (all processes)", cpu_ms["1"], cpu_ms["16"]),
             ("server steps per forward", "", f"{steps_per_forward:.1f}"), ("identical to HF generate", identical, identical),
             ("chaos: completed / identical / killed", "", f"{chaos_result['completed']} / "
              f"{chaos_result['identical']} / {chaos_result['killed']}"),
             ("chaos: cache in use after (bytes)", "", used_after_load),
             ("fuzz: answered or closed / frames", "", f"{fuzz_result['answered_or_closed']} / "
              f"{fuzz_result['frames']}"),
             ("fuzz: server up / sessions intact", "", f"{fuzz_result['server_up']} / "
              f"{fuzz_result['sessions_intact']}")]
    result = {"bench": "swarm_load", "model": size, "clients": clients, "tokens": n,
              "tokens_per_s": {k: round(v, 2) for k, v in tps.items()}, "identical": identical,
              "tokens_per_s_runs": {"1": [round(v, 2) for v in runs1], "16": [round(v, 2) for v in runs16],
                                    "16_head_alone": [round(v, 2) for v in runs16_alone]},
              "p50_step_ms": p50, "p99_step_ms": p99, "cores_busy": cores, "cpu_ms_per_token": cpu_ms,
              "steps_per_forward": round(steps_per_forward, 2), "chaos": chaos_result, "fuzz": fuzz_result,
              "speedup_16_head_alone_vs_1": round(tps["16_head_alone"] / tps["1"], 2),
              "bars": {"speedup_16_vs_1": round(tps["16"] / tps["1"], 2)}}
    emit("swarm_load", table, result, args.save)


if __name__ == "__main__":
    main()
