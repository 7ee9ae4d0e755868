"""``python -m continuous.server``: serve a span of a model's blocks in a swarm.

See :mod:`continuous.remote.server.server` and ``python -m continuous.server --help``.
"""

from continuous.remote.server.server import main

if __name__ == "__main__":
    main()
