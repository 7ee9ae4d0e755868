"""Starting and stopping ``python -m continuous.serve`` in a subprocess on a free localhost port."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
CONTEXT = 512
NAME = "tiny-chat"
TIMEOUT = 60.0  # seconds for any one client call


@dataclass
class Server:
    url: str
    pid: int
    model_dir: Path

    def client(self, **options):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", timeout=TIMEOUT, max_retries=0, **options)

    def health(self) -> dict:
        with urllib.request.urlopen(self.url + "/health", timeout=TIMEOUT) as answer:
            return json.loads(answer.read())

    def wait_idle(self, timeout: float = 30.0) -> dict:
        """The health once no request is in flight (fails after ``timeout`` seconds)."""
        deadline = time.monotonic() + timeout
        while (health := self.health())["in_flight"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert health["in_flight"] == 0, health
        return health




def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(model_dir: Path, log: Path, *args: str) -> Server:
    """A server on a free port, once it answers ``/health`` (its process is started here)."""
    port = _free_port()
    command = [sys.executable, "-m", "continuous.serve", str(model_dir), "--port", str(port),
               "--served-model-name", NAME, "--dtype", "float32", "--log-level", "warning", *args]
    with open(log, "w") as out:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    server = Server(f"http://127.0.0.1:{port}", proc.pid, model_dir)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            server.health()
            return server
        except OSError:
            time.sleep(0.2)
    stop(proc.pid)
    raise RuntimeError(f"the server did not answer in 180 s:\n{log.read_text()[-3000:]}")


def stop(pid: int) -> None:
    """Stop the server by its pid: SIGTERM, then SIGKILL if it lingers."""
    try:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if os.waitpid(pid, os.WNOHANG) != (0, 0):
                return
            time.sleep(0.1)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass
