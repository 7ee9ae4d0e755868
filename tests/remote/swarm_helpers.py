"""Settings of the test swarm: a small cache budget and session timeout make the limits testable."""

from functools import partial

from continuous.demo.swarm import Swarm as _Swarm

CACHE_BYTES = 1_000_000
SERVER_MAX_LENGTH = 1024
SESSION_TIMEOUT = 30.0

Swarm = partial(_Swarm, cache_bytes=CACHE_BYTES, max_length=SERVER_MAX_LENGTH, session_timeout=SESSION_TIMEOUT)
