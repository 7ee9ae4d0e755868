"""A conversation whose KV cache lives on a swarm of two servers, each serving half of the blocks.

The script starts the servers itself (on 127.0.0.1), runs the same conversation through
``models.remote`` and locally, and shows that both give the same text and forward the
same tokens. Before the last turn it kills the server of the first span: a spare
serving the same blocks takes over, and the conversation goes on unchanged. Every
server is stopped at the end.

    python examples/swarm.py [--quick]
"""

import argparse
import tempfile
import time

import torch

from continuous import continuous, generate, models
from continuous.assets import DEMO_MODEL
from continuous.demo.swarm import Swarm

TURNS = ["Hi, I am Priya and I live in Oslo.", "I have a cat.", "Where do I live?", "Thanks!"]


def converse(model, turns, max_tokens, before_turn=lambda i, state: None):
    """Run the turns; return the final state and the tokens each turn forwarded."""
    chat = continuous(generate.text(model))
    state, spent = "", []
    for i, user in enumerate(turns):
        before_turn(i, state)
        before = model.stats.tokens_forwarded
        # An answer cut by max_tokens has no newline of its own.
        newline = "" if str(state).endswith("\n") or not str(state) else "\n"
        state = chat(state + f"{newline}User: {user}\nAssistant:", max_tokens=max_tokens, stop_at="\n")
        spent.append(model.stats.tokens_forwarded - before)
    return state, spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two turns, short answers")
    args = parser.parse_args()
    turns, max_tokens = (TURNS[:3], 12) if args.quick else (TURNS, 24)
    local = models.transformers(DEMO_MODEL, dtype=torch.float32)
    layers = local.model.config.num_hidden_layers
    first, second = f"0:{layers // 2}", f"{layers // 2}:{layers}"

    with tempfile.TemporaryDirectory() as logs, Swarm(DEMO_MODEL, logs, max_length=1024) as swarm:
        print(f"Starting servers for blocks {first}, {second} and a spare for {first}...", flush=True)
        t = time.perf_counter()
        swarm.start(first)
        swarm.start(second, first)
        print(f"  swarm ready in {time.perf_counter() - t:.1f}s: {len(swarm.maddrs)} servers\n", flush=True)
        remote = models.remote(DEMO_MODEL, initial_peers=swarm.maddrs, max_length=512, max_batch=1)

        def crash_before_last(i, state):
            if i == len(turns) - 1 and i > 0:
                victim = state.kv_cache.session.servers[0][0]
                swarm.by_peer(victim).kill()
                print(f"(killed the server of blocks {first} before turn {i + 1}; its spare takes over)\n")

        state, remote_spent = converse(remote, turns, max_tokens, crash_before_last)
        remote.model.shutdown()
    local_state, local_spent = converse(local, turns, max_tokens)
    print(str(state))
    print(f"\ntokens forwarded per turn: swarm {remote_spent}, local {local_spent}")
    print(f"same text on the swarm and locally: {str(state) == str(local_state)}")


if __name__ == "__main__":
    main()
