"""``python -m continuous.serve`` in a subprocess on a free localhost port, for tests and benchmarks.

:func:`start` returns once the server answers ``/health``; :func:`stop` ends it by its pid.
:func:`save_chat_model` saves a test model with a small chat template, to serve.
"""

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

from support.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
#: A chat template for the test models (they have none): roles in markers, turns ending with EOS.
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
NAME = "served"  # the name the served model answers to
TIMEOUT = 60.0  # seconds for any one client call


@dataclass
class Server:
    """A running server: its address and its process id."""

    url: str
    pid: int

    def client(self, **options):
        """An ``openai.OpenAI`` client of this server (no retries, bounded in time)."""
        import openai

        options = {"timeout": TIMEOUT, "max_retries": 0, **options}
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", **options)

    def health(self) -> dict:
        with urllib.request.urlopen(self.url + "/health", timeout=TIMEOUT) as answer:
            return json.loads(answer.read())

    def wait_idle(self, timeout: float = 30.0) -> dict:
        """The health once no request is in flight (fails after ``timeout`` seconds)."""
        return wait_until(lambda: (health := self.health())["in_flight"] == 0 and health,
                          "no request in flight", timeout, every=0.05)


def save_chat_model(path: Path, size: str = "tiny", context: int = 512) -> Path:
    """A test model of this size with :data:`TEMPLATE` as its chat template, saved under ``path``."""
    from support.models import build_model_dir

    path = build_model_dir(path, size=size, max_position_embeddings=context)
    config = json.loads((path / "tokenizer_config.json").read_text())
    if config.get("chat_template") is None and not (path / "chat_template.jinja").exists():
        (path / "chat_template.jinja").write_text(TEMPLATE)
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(model_dir: Path, log: Path, *args: str, wait: float = 300.0, python: str = sys.executable) -> Server:
    """A server of ``model_dir`` on a free port, once it answers ``/health`` (stop it with :func:`stop`).

    ``python`` runs it: the library's environment, where the caller's is a client's own.
    """
    port = _free_port()
    command = [python, "-m", "continuous.serve", str(model_dir), "--port", str(port),
               "--served-model-name", NAME, "--log-level", "warning", *args]
    with open(log, "w") as out:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    server = Server(f"http://127.0.0.1:{port}", proc.pid)
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}:\n{Path(log).read_text()[-3000:]}")
        try:
            server.health()
            return server
        except OSError:
            time.sleep(0.2)
    stop(proc.pid)
    raise RuntimeError(f"the server did not answer in {wait:.0f} s:\n{Path(log).read_text()[-3000:]}")


def stop(pid: int) -> None:
    """End the server by its pid: SIGTERM, then SIGKILL if it lingers."""
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


def in_process(app, api_key: str = "none", **options):
    """An ``openai.OpenAI`` client of ``app`` run in this process (no socket, no subprocess).

    Close it after use (``with in_process(app) as client:``): that stops the app's thread.
    """
    import openai
    from fastapi.testclient import TestClient

    options = {"timeout": TIMEOUT, "max_retries": 0, **options}
    return openai.OpenAI(base_url="http://testserver/v1", api_key=api_key, http_client=TestClient(app), **options)
