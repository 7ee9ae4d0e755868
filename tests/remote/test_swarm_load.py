"""The swarm under concurrent clients, chaos and hostile input, on 127.0.0.1 (small sizes of
``benchmarks/swarm_load.py``): outputs equal transformers' greedy generate every time."""

import threading

import pytest
import torch
from hivemind.p2p import PeerID
from support.stress import FUZZ_KINDS, Chaos, budget_in_use, fuzz, greedy_clients
from swarm_helpers import CACHE_BYTES

from continuous.remote.client.routing import SwarmClient
from continuous.remote.wire.protocol import default_dht_prefix

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _prompts(k):
    return [torch.tensor([[0] + [(7 * i + 13 * j) % 500 + 3 for j in range(4 + i)]]) for i in range(k)]


def _expected(local_model, prompts, n):
    return [local_model.generate(p, max_new_tokens=n, min_new_tokens=n, do_sample=False)[:, p.shape[1]:]
            for p in prompts]


def _live_peers(swarm):
    return [PeerID.from_base58(s.peer_id) for s in swarm.servers if s.alive()]


def test_concurrent_clients_equal_local(swarm, remote_model, local_model):
    prompts = _prompts(6)
    outs, latencies, _ = greedy_clients(remote_model, prompts, 8)
    assert all(o is not None and torch.equal(o, e) for o, e in zip(outs, _expected(local_model, prompts, 8)))
    assert len(latencies) == 6 * 8
    assert budget_in_use(remote_model.swarm, _live_peers(swarm), CACHE_BYTES) == 0


def test_fuzz_under_load(swarm, swarm_model_dir, remote_model, local_model):
    target = next(s for s in swarm.servers if s.alive() and s.blocks == "1:2")
    hostile = SwarmClient(swarm.maddrs, default_dht_prefix(swarm_model_dir), 2)
    result = {}
    try:
        fuzzer = threading.Thread(target=lambda: result.update(
            fuzz(hostile, PeerID.from_base58(target.peer_id), 120, 64, 1, 2, timeout=10)))
        fuzzer.start()
        prompts = _prompts(2)
        outs, _, _ = greedy_clients(remote_model, prompts, 40)
        fuzzer.join(120)
    finally:
        hostile.shutdown()
    assert result["frames"] >= 120 and result["answered_or_closed"] == result["frames"]
    assert all(result["kinds"][k] > 0 for k in FUZZ_KINDS)
    assert target.alive()
    assert all(o is not None and torch.equal(o, e) for o, e in zip(outs, _expected(local_model, prompts, 40)))
    assert budget_in_use(remote_model.swarm, _live_peers(swarm), CACHE_BYTES) == 0


def test_chaos(swarm, remote_model, local_model):
    swarm.ensure("0:1", 2)
    prompts = _prompts(4)
    with Chaos(swarm, period=1.0) as chaos:
        outs, _, _ = greedy_clients(remote_model, prompts, 150)
    assert chaos.killed  # at least one server died under the clients
    assert all(o is not None and torch.equal(o, e) for o, e in zip(outs, _expected(local_model, prompts, 150)))
    assert budget_in_use(remote_model.swarm, _live_peers(swarm), CACHE_BYTES) == 0
