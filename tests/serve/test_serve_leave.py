"""Clients that leave during a long prefill, served for real by uvicorn in a thread of this process.

The model forwards a long prompt 16 tokens at a time. A gate around the engine's forward of
one request holds the third chunk until the client is gone and its call is marked cancelled:
the call must then end after that chunk (its slot back, the rest of its prompt never
forwarded), while ``/health`` answers all along. A raw socket is the client, so that leaving
is closing the connection, as a real client does.
"""

from __future__ import annotations

import json
import socket
import threading

import httpx2
import pytest
import uvicorn
from support.serving import NAME, save_chat_model
from support.waiting import wait_until

from continuous import models
from continuous.serve import build_app

CHUNK = 16
#: Chunks the gate lets through before it holds the next one.
FREE = 2
PROMPT = "Tell me about " + " and ".join(["Alice", "Bob", "Carol"] * 40) + "."


class Gate:
    """The engine's forward of one request, holding each one after the first ``free`` until opened."""

    def __init__(self, run_one, free: int):
        self.run_one, self.free = run_one, free
        self.cond = threading.Condition()
        self.arrived = 0
        self.opened = False

    def __call__(self, request):
        with self.cond:
            self.arrived += 1
            self.cond.notify_all()
            self.cond.wait_for(lambda: self.opened or self.arrived <= self.free)
        return self.run_one(request)

    def open(self) -> None:
        with self.cond:
            self.opened = True
            self.cond.notify_all()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = save_chat_model(tmp_path_factory.mktemp("leave") / "tiny", "tiny", 2048)
    return models.transformers(str(path), dtype="float32", prefill_chunk=CHUNK)


@pytest.fixture(scope="module")
def base_url(model):
    server = uvicorn.Server(uvicorn.Config(build_app(model, name=NAME, max_queue=4), host="127.0.0.1", port=0,
                                           log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started, "the server to start")
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.fixture
def gate(model):
    engine = model.engine
    gate = Gate(engine.run_one, FREE)
    engine.run_one = gate
    try:
        yield gate
    finally:
        gate.open()  # a failed test leaves no forward held
        engine.run_one = gate.run_one


def health(base_url: str) -> dict:
    answer = httpx2.get(f"{base_url}/health", timeout=30)
    assert answer.status_code == 200
    return answer.json()


def post(base_url: str, body: dict) -> socket.socket:
    """A connection that sent a chat request and reads nothing."""
    host, port = base_url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: served\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def cancelled(model) -> bool:
    table = model.engine.table
    return any(c.cancelled for c in [*table.calls.values(), *table.waiting])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_client_leaving_during_prefill_frees_its_slot_within_one_chunk(model, base_url, gate, stream):
    prompt = len(model.tokenizer(PROMPT)["input_ids"])
    assert prompt > 6 * CHUNK  # the abandoned prefill would forward many more chunks than it may
    wait_until(lambda: health(base_url)["in_flight"] == 0 and model.engine.running() == 0, "an idle server")
    before = model.stats.tokens_forwarded
    sock = post(base_url, {"model": NAME, "messages": [{"role": "user", "content": PROMPT}],
                           "max_tokens": 4, "stream": stream})
    try:
        wait_until(lambda: gate.arrived > FREE, "the prefill's held chunk")
        assert health(base_url)["in_flight"] == 1  # the server answers while a prefill runs
    finally:
        sock.close()
    wait_until(lambda: cancelled(model), "the engine to hear that the client left")
    assert health(base_url)["in_flight"] == 1  # the held chunk is still under way, and /health answers
    gate.open()
    wait_until(lambda: health(base_url)["in_flight"] == 0, "the slot to come back")
    wait_until(lambda: model.engine.running() == 0, "the call to leave the engine")
    # The held chunk was the last: the rest of the prompt was never forwarded, nor anything again.
    assert gate.arrived == FREE + 1
    assert model.stats.tokens_forwarded - before == (FREE + 1) * CHUNK
