"""Server processes of a local swarm on 127.0.0.1, started and stopped by their ids.

Used by the tests, the swarm benchmark and the demo: each server is a
``python -m continuous.remote.server`` subprocess in its own process group.

Every process started here is stopped by its id: a server gets SIGTERM (it then leaves
the DHT and stops its libp2p daemon), and its process group (the server and its p2pd)
gets SIGKILL if anything is left.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

START_TIMEOUT = 90.0


class Server:
    """A ``python -m continuous.remote.server`` subprocess."""

    def __init__(self, model_dir: Path, blocks: str, initial_peers: list[str], log_dir: Path, *,
                 cache_bytes: int = 2**30, max_length: int = 2048, session_timeout: float = 300.0,
                 update_period: float = 2.0, threads: int = 1):
        # One torch thread by default: the servers of a local swarm share the cores with each
        # other and with the clients, and more threads per process only fight over them.
        cmd = [sys.executable, "-m", "continuous.remote.server", "--model", str(model_dir), "--blocks", blocks,
               "--cache-bytes", str(cache_bytes), "--max-length", str(max_length),
               "--session-timeout", str(session_timeout), "--update-period", str(update_period),
               "--threads", str(threads)]
        cmd += ["--initial-peers", *initial_peers] if initial_peers else ["--new-swarm"]
        self.blocks = blocks
        self.log = log_dir / f"server-{blocks.replace(':', '_')}-{time.monotonic_ns()}.log"
        with open(self.log, "w") as log:
            # Its own process group, so that its p2pd can be killed with it.
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True,
                                         start_new_session=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        self.maddr = None

    def wait_ready(self, timeout: float = START_TIMEOUT) -> str:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline().strip() if ready else ""
        if "/p2p/" not in line:
            self.stop()
            raise RuntimeError(f"server {self.blocks} did not start: {line!r}\n{self.log.read_text()[-3000:]}")
        self.maddr = line
        return line

    @property
    def peer_id(self) -> str:
        return self.maddr.rsplit("/p2p/", 1)[1]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """Die at once, with the daemon: a crash."""
        sockets = self._daemon_sockets()
        _killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        for path in sockets:  # a killed daemon cannot remove its unix sockets itself
            path.unlink(missing_ok=True)

    def _daemon_sockets(self) -> list[Path]:
        """The unix sockets of this server's p2pd (named in its command line), and of its client."""
        try:
            children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        except OSError:
            return []
        for child in children:
            try:
                args = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            for arg in args:
                if arg.startswith(b"-listen=/unix/"):
                    daemon = Path(arg.decode()[len("-listen=/unix"):])
                    return [daemon, daemon.with_name(daemon.name.replace("-p2pd-", "-p2pclient-"))]
        return []

    def stop(self, timeout: float = 15.0) -> int:
        """Leave gracefully (SIGTERM), then make sure nothing of the group is left."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        _killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        self.proc.stdout.close()
        return self.proc.returncode


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class Swarm:
    """Servers of one model on this machine; ``start`` adds servers, ``stop_all`` ends them.

    Parameters
    ----------
    model_dir
        The model every server loads its blocks from.
    log_dir
        Where each server's stderr goes.
    **server_options
        ``cache_bytes``, ``max_length``, ``session_timeout``, ``update_period``, ``threads`` of every server.
    """

    def __init__(self, model_dir: Path, log_dir: Path, **server_options):
        self.model_dir, self.log_dir = Path(model_dir), Path(log_dir)
        self.server_options = server_options
        self.servers: list[Server] = []

    def __enter__(self) -> "Swarm":
        return self

    def __exit__(self, *exc) -> None:
        self.stop_all()

    @property
    def maddrs(self) -> list[str]:
        return [s.maddr for s in self.servers if s.alive() and s.maddr]

    def start(self, *blocks: str) -> list[Server]:
        """Start servers for ``blocks`` (in parallel) and wait until they are ready."""
        peers = self.maddrs
        new = [Server(self.model_dir, b, peers, self.log_dir, **self.server_options) for b in blocks]
        self.servers += new
        for s in new:
            s.wait_ready()
        return new

    def ensure(self, blocks: str, count: int) -> None:
        """Make sure ``count`` live servers hold ``blocks``."""
        live = [s for s in self.servers if s.alive() and s.blocks == blocks]
        if len(live) < count:
            self.start(*[blocks] * (count - len(live)))
            time.sleep(1.0)  # let the DHT records spread

    def by_peer(self, peer_id: str) -> Server:
        return next(s for s in self.servers if s.maddr and s.peer_id == peer_id)

    def stop_all(self) -> None:
        for s in self.servers:  # all leave at once, then each is waited for
            if s.alive():
                s.proc.send_signal(signal.SIGTERM)
        for s in self.servers:
            s.stop()
