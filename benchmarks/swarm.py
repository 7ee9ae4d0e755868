"""Greedy decoding through a swarm of two servers on 127.0.0.1, against the same model locally;
then a server killed mid-generation, with a spare serving the same blocks.

    python benchmarks/swarm.py [--quick] [--save] [--reps N]
"""

from __future__ import annotations

import tempfile

import torch

from common import emit, median, random_text, setup, timed
from continuous import continuous, generate, models
from continuous.remote.launch import Swarm


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
    with tempfile.TemporaryDirectory() as logs, Swarm(path, logs, max_length=1024) as swarm:
        _, start_s = timed(lambda: (swarm.start(half[0]), swarm.start(half[1], half[0])))
        remote = models.remote(path, initial_peers=swarm.maddrs, max_length=512, max_batch=1)
        gens = {"local": continuous(generate.text(local)), "remote": continuous(generate.text(remote))}
        bases = {k: g(prompt, max_tokens=0) for k, g in gens.items()}  # prefilled: time decoding only
        ms, tokens = {"local": [], "remote": []}, {}
        for _ in range(args.reps):
            for name, model in (("local", local), ("remote", remote)):
                t, tokens[name] = decode_ms(model, gens[name], bases[name], n)
                ms[name].append(t)
        ids = torch.tensor([tok(prompt).input_ids])
        dist = remote.model
        hf_out = hf.generate(ids, max_new_tokens=n, do_sample=False)
        dist_out = dist.generate(ids, max_new_tokens=n, do_sample=False)
        identical = tokens["local"] == tokens["remote"] and torch.equal(hf_out, dist_out)

        # Failover: kill the server of the first span between two steps of a session.
        with dist.inference_session(max_length=n + ids.shape[1] + 1) as session:
            parts = [dist.generate(ids, session=session, max_new_tokens=n // 2, do_sample=False)]
            one, normal = timed(lambda: dist.generate(None, session=session, max_new_tokens=1, do_sample=False))
            victim = session.servers[0][0]
            swarm.by_peer(victim).kill()
            # The first step after the crash routes a replacement and replays the history there.
            after, recovery = timed(lambda: dist.generate(None, session=session, max_new_tokens=1, do_sample=False))
            rest = dist.generate(None, session=session, max_new_tokens=n - n // 2 - 2, do_sample=False)
            moved = session.servers[0][0] != victim
        generated = torch.cat(parts + [one, after, rest], 1)[:, -n:]
        failover_identical = moved and torch.equal(generated, hf_out[:, -n:])
        remote.model.shutdown()
    med = {k: round(median(v), 3) for k, v in ms.items()}
    table = [("", "ms/token (median)"), ("local", med["local"]), ("remote (2 servers)", med["remote"]),
             ("ratio", f"{med['remote'] / med['local']:.2f}"), ("identical tokens", identical),
             ("failover identical", failover_identical), ("recovery s (first step after the crash)", f"{recovery:.2f}"),
             ("normal step s", f"{normal:.3f}"), ("swarm start s", f"{start_s:.1f}")]
    result = {"bench": "swarm", "model": size, "identical": identical, "ms_per_token": med,
              "failover": {"identical": failover_identical, "recovery_s": round(recovery, 3),
                           "normal_step_s": round(normal, 4)},
              "bars": {"remote_vs_local": round(med["remote"] / med["local"], 3)}}
    emit("swarm", table, result, args.save)


if __name__ == "__main__":
    main()
