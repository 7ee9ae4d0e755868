"""``python -m continuous.remote.server``: serve a span of a model's blocks in a swarm.

Installed as the command ``continuous-swarm-server`` too. The arguments are read before
torch and hivemind are imported, so that ``--help`` and mistakes answer at once. See
:mod:`continuous.remote.server.server`.
"""

from __future__ import annotations

import argparse
import sys

#: The dtypes a server computes in.
DTYPES = ("bfloat16", "float16", "float32")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The server's arguments; exits with a usage message on a mistake."""
    parser = argparse.ArgumentParser(prog="python -m continuous.remote.server",
                                     description="Serve a span of a model's blocks in a swarm.")
    parser.add_argument("--model", required=True, help="directory of the model (config, safetensors)")
    parser.add_argument("--blocks", required=True, help="START:END, the blocks to serve (END excluded)")
    swarm = parser.add_mutually_exclusive_group(required=True)
    swarm.add_argument("--new-swarm", action="store_true", help="start a new swarm")
    swarm.add_argument("--initial-peers", nargs="+", metavar="MADDR", help="multiaddresses of peers to join")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--cache-bytes", type=int, default=2**30, help="attention cache budget in bytes")
    parser.add_argument("--max-length", type=int, default=2048, help="longest session accepted")
    parser.add_argument("--session-timeout", type=float, default=300.0, help="idle seconds before a session closes")
    parser.add_argument("--dht-prefix", default=None, help="name to announce the blocks under")
    parser.add_argument("--dtype", default="float32", choices=DTYPES)
    parser.add_argument("--update-period", type=float, default=10.0, help="seconds between DHT announcements")
    parser.add_argument("--open-timeout", type=float, default=5.0, help="seconds a new stream has to open a session")
    parser.add_argument("--max-streams-per-peer", type=int, default=64, help="streams one peer may hold at once")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads of the compute (default: torch's, one per core)")
    args = parser.parse_args(argv)
    try:
        args.start, args.end = (int(x) for x in args.blocks.split(":"))
    except ValueError:
        parser.error(f"--blocks must look like START:END, got {args.blocks!r}")
    if not 0 <= args.start < args.end:
        parser.error(f"--blocks must name at least one block, START < END, got {args.blocks!r}")
    return args


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``python -m continuous.remote.server`` and ``continuous-swarm-server``."""
    args = parse_args(argv)
    # Imported only now: torch and hivemind take seconds to import.
    from continuous.remote.server.server import run

    run(args)
    sys.exit(0)


if __name__ == "__main__":
    main()
