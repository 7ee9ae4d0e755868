"""Greedy decoding through a swarm of two servers on 127.0.0.1, against the same model locally;
then a server killed while a step is in flight, with a spare serving the same blocks.

The local baseline runs interleaved with the remote runs, while the servers are idle
(they hold no step; their processes sleep): this machine's speed drifts from minute to
minute, and a baseline taken before the servers start would carry that drift into the ratio.

    python benchmarks/swarm.py [--quick] [--save] [--reps N]
"""

from __future__ import annotations

import tempfile
import threading
import time

import torch
from common import emit, median, random_text, setup, timed

from continuous import continuous, generate, models
from continuous.demo.swarm import Swarm


def decode_ms(model, gen, base, n):
    """ms per forward of a greedy continuation of ``base`` by ``n`` tokens, and its tokens."""
    before = model.stats.forward_calls
    out, t = timed(lambda: gen(base, max_tokens=n))
    return t * 1e3 / (model.stats.forward_calls - before), out._rows.real_ids(0)


def main():
    args, size, hf, tok, local = setup(__doc__)
    path = local.model.config._name_or_path
    layers = hf.config.num_hidden_layers
    half = f"0:{layers // 2}", f"{layers // 2}:{layers}"
    n = 16 if args.quick else 64
    prompt = random_text(tok, 32, seed=11)
    ids = torch.tensor([tok(prompt).input_ids])

    gen_local = continuous(generate.text(local))
    base_local = gen_local(prompt, max_tokens=0)  # prefilled: time decoding only
    ms = {"local": [], "remote": [], "bridge": []}
    tokens = {}
    with torch.inference_mode():
        hf_out = hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)

    with tempfile.TemporaryDirectory() as logs, Swarm(path, logs, max_length=1024) as swarm:
        _, start_s = timed(lambda: (swarm.start(half[0]), swarm.start(half[1], half[0])))
        remote = models.remote(path, initial_peers=swarm.maddrs, max_length=512, max_batch=1)
        dist = remote.model
        gen_remote = continuous(generate.text(remote))
        base_remote = gen_remote(prompt, max_tokens=0)
        for _ in range(args.reps):
            t, tokens["local"] = decode_ms(local, gen_local, base_local, n)
            ms["local"].append(t)
            t, tokens["remote"] = decode_ms(remote, gen_remote, base_remote, n)
            ms["remote"].append(t)
            # The transformers generate() bridge: prefill and decode, per new token.
            dist_out, t = timed(lambda: dist.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False))
            ms["bridge"].append(t * 1e3 / n)
        identical = tokens["local"] == tokens["remote"] and torch.equal(hf_out, dist_out)

        # Failover: kill the first span's server while a step is in flight.
        latencies, state = [], {"in_step": False, "in_flight": None}
        with dist.inference_session(max_length=n + ids.shape[1] + 1) as session:
            step = session.step

            def timed_step(*a, **k):
                started = time.perf_counter()
                state["in_step"] = True
                try:
                    return step(*a, **k)
                finally:
                    state["in_step"] = False
                    latencies.append(time.perf_counter() - started)

            def kill():
                state["in_flight"] = state["in_step"]  # whether the kill hit a step (measured, not assumed)
                swarm.by_peer(victim).kill()

            session.step = timed_step
            dist.generate(ids, session=session, max_new_tokens=1, do_sample=False)  # route the chain
            victim = session.servers[0][0]
            normal = median(ms["bridge"]) / 1e3
            # A step is in flight almost all the time during generate(): kill at half-way.
            killer = threading.Timer(normal * n / 2, kill)
            session.position = 0
            killer.start()
            out = dist.generate(ids, session=session, max_new_tokens=n, min_new_tokens=n, do_sample=False)
            killer.join()
            moved = session.servers[0][0] != victim
        failover_identical = moved and torch.equal(out[:, -n:], hf_out[:, -n:])
        recovery = max(latencies)
        dist.shutdown()
    med = {k: round(median(v), 3) for k, v in ms.items()}
    table = [("", "ms/token (median)"), ("local (interleaved, servers idle)", med["local"]),
             ("remote (2 servers)", med["remote"]), ("generate() bridge", med["bridge"]),
             ("ratio remote/local", f"{med['remote'] / med['local']:.2f}"), ("identical tokens", identical),
             ("failover identical", failover_identical), ("kill hit a step in flight", state["in_flight"]),
             ("recovery s (the step the kill hit)", f"{recovery:.2f}"),
             ("normal step s", f"{normal:.3f}"), ("swarm start s", f"{start_s:.1f}")]
    result = {"bench": "swarm", "model": size, "identical": identical, "ms_per_token": med,
              "ms_per_token_runs": {k: [round(x, 2) for x in v] for k, v in ms.items()},
              "failover": {"identical": failover_identical, "recovery_s": round(recovery, 3),
                           "normal_step_s": round(normal, 4), "in_flight": state["in_flight"]},
              "bars": {"remote_vs_local": round(med["remote"] / med["local"], 3)}}
    emit("swarm", table, result, args.save)


if __name__ == "__main__":
    main()
