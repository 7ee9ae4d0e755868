"""Deprecated name of the swarm's block server: run ``python -m continuous.remote.server``
(or ``continuous-swarm-server``) instead. This module goes in the next release.

``python -m continuous.server ARGS`` warns, then serves as the new command does.
"""

from __future__ import annotations

import warnings

from continuous.remote.server.__main__ import DTYPES, main, parse_args

__all__ = ["DTYPES", "main", "parse_args"]

warnings.warn("python -m continuous.server is deprecated and goes in the next release: run "
              "python -m continuous.remote.server (or continuous-swarm-server) with the same arguments",
              DeprecationWarning, stacklevel=1 if __name__ == "__main__" else 2)

if __name__ == "__main__":
    main()
