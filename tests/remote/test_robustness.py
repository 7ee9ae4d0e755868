"""Bounds and robustness without a network: the handler fed by in-memory streams, and the
client's parts given malformed replies.

Each handler test runs one ``InferenceHandler`` call on a stream whose bytes the test
writes, and reads back what the server answered; nothing is timed, every wait is bounded.
"""

import asyncio
import random

import pytest
import torch
from hivemind.p2p import PeerID

from continuous.remote.client.bridge import SwarmSessionCache
from continuous.remote.client.routing import Hop, ServerInfo
from continuous.remote.client.session import InferenceSession, ServerSession, _Span
from continuous.remote.server.blocks import Blocks
from continuous.remote.server.handler import InferenceHandler
from continuous.remote.server.memory import MemoryBudget, SessionCache
from continuous.remote.wire.protocol import (
    MAX_FRAME_BYTES,
    BadRequestError,
    RemoteError,
    ServerFaultError,
    pack,
    read_message,
    write_message,
)

pytestmark = pytest.mark.timeout(120)

HIDDEN = 64


class _Writer:
    """The server's side of a stream: what it writes can be read back as replies."""

    def __init__(self):
        self.replies = asyncio.StreamReader()
        self.closed = False

    def write(self, data):
        if not self.closed:
            self.replies.feed_data(bytes(data))

    async def drain(self):
        pass

    def close(self):
        if not self.closed:
            self.closed = True
            self.replies.feed_eof()


class _Info:
    def __init__(self, peer: str):
        self.peer_id = peer


@pytest.fixture(scope="module")
def blocks(swarm_model_dir):
    return Blocks(swarm_model_dir, 0, 2)


def _handler(blocks, budget=2**24, **kwargs) -> InferenceHandler:
    options = dict(open_timeout=0.3, max_streams_per_peer=8, chunk_tokens=4)
    options.update(kwargs)
    return InferenceHandler(blocks, MemoryBudget(budget), max_length=256, session_timeout=5.0, **options)


async def _messages(writer: _Writer) -> list[dict]:
    """Every reply the server wrote, until it closed the stream."""
    out = []
    while True:
        try:
            metadata, tensors = await read_message(writer.replies, 2**24, timeout=5, response=True)
        except asyncio.IncompleteReadError:
            return out
        out.append(dict(metadata, tensors=tensors))


async def _serve(handler, messages, peer="peer-a", feed=None):
    """Run one stream through ``handler``: ``messages`` (metadata, tensors) then EOF; return the replies."""
    reader, writer = asyncio.StreamReader(), _Writer()

    class _Client:  # write_message wants a writer: this one feeds the server's reader
        def write(self, data):
            reader.feed_data(bytes(data))

        async def drain(self):
            pass

    for metadata, tensors in messages:
        await write_message(_Client(), metadata, tensors)
    if feed is not None:
        reader.feed_data(feed)
    reader.feed_eof()
    await asyncio.wait_for(handler(_Info(peer), reader, writer), 30)
    return await _messages(writer)


OPEN = {"type": "open", "start": 0, "end": 2, "max_length": 256, "batch_size": 4}


def _step(start, n, rows=1):
    return {"type": "step", "start_position": start, "tensors": ["hidden_states"]}, [torch.randn(rows, n, HIDDEN)]


def test_a_silent_stream_is_closed_after_the_open_timeout(blocks):
    handler = _handler(blocks)

    async def go():
        reader, writer = asyncio.StreamReader(), _Writer()  # never fed: a peer that says nothing
        await asyncio.wait_for(handler(_Info("silent"), reader, writer), 10)
        return await _messages(writer)

    replies = asyncio.run(go())
    assert [r["code"] for r in replies] == ["protocol"] and "open message within" in replies[0]["error"]
    assert handler.streams == {}


def test_streams_per_peer_are_capped(blocks):
    handler = _handler(blocks, max_streams_per_peer=2, open_timeout=1.0)

    async def go():
        silent = []
        for _ in range(2):  # two streams held open by a peer that sends nothing
            reader, writer = asyncio.StreamReader(), _Writer()
            silent.append(asyncio.create_task(handler(_Info("greedy"), reader, writer)))
        await asyncio.sleep(0)
        third = await _serve(handler, [(OPEN, [])], peer="greedy")
        other = await _serve(handler, [(OPEN, []), _step(0, 2)], peer="polite")
        await asyncio.gather(*silent)
        return third, other

    third, other = asyncio.run(go())
    assert [r["code"] for r in third] == ["allocation"] and "too many streams" in third[0]["error"]
    assert other[0]["ok"] and other[1]["ok"]  # another peer is served meanwhile
    assert handler.streams == {} and handler.budget.used_bytes == 0


def test_a_session_reserves_what_it_holds(blocks):
    handler = _handler(blocks)
    seen = []
    handler.on_change = lambda: seen.append(handler.budget.used_bytes)
    replies = asyncio.run(_serve(handler, [(OPEN, []), _step(0, 3), _step(3, 70)]))
    assert all(r.get("ok") for r in replies)
    one_row = blocks.cache_nbytes(2, 1, SessionCache.MIN_LENGTH)
    # One row of 64 positions after the first step, 128 after the second; not 4 rows x 256.
    assert seen[:2] == [one_row, 2 * one_row]
    assert seen[-1] == 0 and handler.budget.used_bytes == 0


def test_a_session_that_could_never_fit_is_refused_at_open(blocks):
    handler = _handler(blocks, budget=blocks.cache_nbytes(2, 4, 256) - 1)
    replies = asyncio.run(_serve(handler, [(OPEN, [])]))
    assert [r["code"] for r in replies] == ["allocation"] and "budget" in replies[0]["error"]


@torch.inference_mode()
def test_chunked_steps_equal_one_step(blocks):
    """A long step runs in chunks of ``chunk_tokens``: the result is that of one forward."""
    x = torch.randn(2, 11, HIDDEN)
    chunked = asyncio.run(_serve(_handler(blocks, chunk_tokens=4), [(dict(OPEN), []), (
        {"type": "step", "start_position": 0, "tensors": ["hidden_states"]}, [x])]))
    whole = asyncio.run(_serve(_handler(blocks, chunk_tokens=64), [(dict(OPEN), []), (
        {"type": "step", "start_position": 0, "tensors": ["hidden_states"]}, [x])]))
    assert torch.allclose(chunked[1]["tensors"][0], whole[1]["tensors"][0], atol=1e-5)


def _garbage(rng: random.Random, kind: int) -> bytes:
    """One malformed frame (header and payload) of the kinds a hostile peer sends."""
    if kind == 0:  # random bytes, with a plausible header
        body = rng.randbytes(rng.randrange(1, 300))
        return len(body).to_bytes(8, "big") + body
    if kind == 1:  # a frame whose declared size is over the limit
        return (MAX_FRAME_BYTES + rng.randrange(1, 2**20)).to_bytes(8, "big")
    if kind == 2:  # truncated: the header promises more than comes
        return (500).to_bytes(8, "big") + rng.randbytes(100)
    # truncated msgpack metadata inside a well-formed protobuf frame
    from hivemind.proto import runtime_pb2

    meta = pack({"type": "step", "start_position": 0, "tensors": ["hidden_states"]})
    body = runtime_pb2.ExpertRequest(metadata=meta[: rng.randrange(1, len(meta))]).SerializeToString()
    return len(body).to_bytes(8, "big") + body


def test_malformed_frames_are_answered_or_closed(blocks):
    """Garbage before or after an open: every stream gets an error reply or is closed, and
    the server holds nothing afterwards."""
    handler = _handler(blocks)
    rng = random.Random(0)

    async def go():
        results = []
        for i in range(40):
            opened = i % 2 == 1
            messages = [(OPEN, [])] if opened else []
            if i % 5 == 4:  # a well-formed step of the wrong shape or dtype
                bad = [torch.randn(1, 2, HIDDEN + 1)] if i % 10 == 4 else [torch.ones(1, 2, HIDDEN, dtype=torch.int64)]
                messages.append(({"type": "step", "start_position": 0, "tensors": ["hidden_states"]}, bad))
                results.append((opened, await _serve(handler, messages)))
            else:
                results.append((opened, await _serve(handler, messages, feed=_garbage(rng, i % 4))))
        return results

    for opened, replies in asyncio.run(go()):
        after_open = replies[1:] if opened else replies
        assert not opened or replies[0].get("ok")
        assert all("error" in r for r in after_open)  # answered with an error, or closed (no reply)
    assert handler.streams == {} and handler.budget.used_bytes == 0


# -- client side ----------------------------------------------------------------------


class _Session:
    def __init__(self, position):
        self.position = position


def test_transformers_cache_crop_follows_transformers_5():
    """crop(n <= 0) removes -n tokens; crop(0) keeps all; a positive n is refused, as by
    transformers' DynamicLayer.crop."""
    cache = SwarmSessionCache(_Session(10))
    cache.crop(0)
    assert cache.session.position == 10
    cache.crop(-3)
    assert cache.session.position == 7
    with pytest.raises(ValueError, match="negative"):
        cache.crop(4)
    cache.crop(-100)
    assert cache.session.position == 0


def _server_session() -> ServerSession:
    info = ServerInfo(PeerID(b"hostile"), 0, 1, free_bytes=10**9, token_bytes=1, max_length=64)
    return ServerSession(None, Hop(info, 0, 1), max_length=16, batch_size=1, hidden_size=HIDDEN)


@pytest.mark.parametrize("reply", [
    ({"ok": True}, [torch.randn(1, 3, HIDDEN)]),  # wrong shape
    ({"ok": True}, [torch.ones(1, 2, HIDDEN, dtype=torch.int64)]),  # wrong dtype
    ({"ok": True}, []),  # no tensor
    ({}, [torch.randn(1, 2, HIDDEN)]),  # not a success
])
def test_a_malformed_reply_is_a_server_fault(reply):
    session = _server_session()

    async def go():
        session._writer, session._replies = _Writer(), asyncio.Queue()
        await session._replies.put(reply)
        return await session._step({"type": "step"}, [torch.randn(1, 2, HIDDEN)])

    with pytest.raises(ServerFaultError, match="malformed") as e:
        asyncio.run(go())
    assert e.value.retryable  # the session fails over instead of ending
    with pytest.raises(RemoteError, match="closed"):
        session.step(torch.randn(1, 2, HIDDEN), 0)  # and this stream is not used again


def test_an_oversized_reply_is_a_server_fault():
    session = _server_session()

    async def go():
        session._replies = asyncio.Queue()
        reader = asyncio.StreamReader()
        reader.feed_data((MAX_FRAME_BYTES * 4).to_bytes(8, "big"))
        await session._read_replies(reader)
        return await session._replies.get()

    error = asyncio.run(go())
    assert isinstance(error, ServerFaultError) and error.retryable and "malformed reply" in str(error)


class _Recorder:
    """A server session that records the steps of a replay and returns its inputs."""

    def __init__(self):
        self.calls = []

    def step(self, x, start, hypo_ids, mask, positions):
        self.calls.append((start, x.shape[1], None if mask is None else mask.shape[1], positions.shape[1]))
        return x * 2


def test_replays_are_chunked():
    session = InferenceSession(None, 64, hidden_size=HIDDEN, replay_chunk=8)
    history = torch.randn(2, 20, HIDDEN)
    session._position, session._positions = 20, torch.arange(20).expand(2, 20)
    session._mask = torch.ones(2, 20, dtype=torch.bool)
    server = _Recorder()
    out = session._replay(server, history)
    assert server.calls == [(0, 8, 8, 8), (8, 8, 16, 8), (16, 4, 20, 4)]
    assert torch.equal(out, history * 2)
    with pytest.raises(ValueError, match="replay_chunk"):
        InferenceSession(None, 64, hidden_size=HIDDEN, replay_chunk=0)


class _FakeServer:
    """A span's server without a network: multiplies its input, or fails as told."""

    def __init__(self, factor, fail=None):
        self.factor, self.fail, self.calls, self.closed = factor, fail, 0, False
        self.peer = PeerID(b"span-%d" % factor)

    async def step_async(self, x, start, hypo_ids, mask, positions):
        self.calls += 1
        if self.fail is not None:
            raise self.fail
        return x * self.factor

    def close(self):
        self.closed = True


def _two_spans(second: _FakeServer, max_retries=3) -> InferenceSession:
    session = InferenceSession(None, 64, hidden_size=HIDDEN, max_retries=max_retries)
    session._spans = [_Span(0, 1, _FakeServer(2)), _Span(1, 2, second)]
    return session


def test_a_step_runs_the_chain_of_spans_in_one_call():
    session = _two_spans(_FakeServer(3))
    x = torch.randn(1, 2, HIDDEN)
    assert torch.equal(session.step(x), x * 6)
    first, second = session._spans
    assert torch.equal(first.inputs, x) and torch.equal(second.inputs, x * 2)  # the histories to replay
    assert first.synced and second.synced and session.position == 2


@pytest.mark.parametrize("error", [BadRequestError("refused"), RemoteError("gone")])
def test_a_failure_in_the_chain_is_the_first_attempt_of_failover(error):
    """A span that fails within the chain is taken over by the failover, which counts it
    as the span's first attempt: a request the server refused ends the step, a retryable
    failure with no retry left too; the spans before it are marked to replay, the
    session's position is unchanged."""
    second = _FakeServer(3, fail=error)
    session = _two_spans(second, max_retries=0)
    x = torch.randn(1, 2, HIDDEN)
    with pytest.raises(type(error), match=str(error)):
        session.step(x)
    assert second.calls == 1  # not sent again by the failover
    assert session.position == 0 and not session._spans[0].synced


@torch.inference_mode()
def test_concurrent_sessions_are_batched_and_unchanged(blocks):
    """Steps of concurrent sessions run as shared forwards; each session's outputs are
    those it gets alone (allclose: only the shapes of the products differ)."""
    torch.manual_seed(1)
    streams = [[(dict(OPEN), []), ({"type": "step", "start_position": 0, "tensors": ["hidden_states"]},
                                   [torch.randn(rows, 3 + i, HIDDEN)])]
               + [({"type": "step", "start_position": 3 + i + k, "tensors": ["hidden_states"]},
                   [torch.randn(rows, 1, HIDDEN)]) for k in range(4)]
               for i, rows in enumerate([1, 2, 1, 3])]
    alone_handler = _handler(blocks)
    alone = [asyncio.run(_serve(alone_handler, s)) for s in streams]
    handler = _handler(blocks, batch_window=0.05)

    async def together():
        return await asyncio.gather(*[_serve(handler, s, peer=f"p{i}") for i, s in enumerate(streams)])

    batched = asyncio.run(together())
    assert handler.batcher.batches < handler.batcher.steps  # some forwards served several sessions
    for a, b in zip(alone, batched):
        assert len(a) == len(b) == 6 and all(r.get("ok") for r in b)
        for ra, rb in zip(a[1:], b[1:]):
            assert torch.allclose(ra["tensors"][0], rb["tensors"][0], atol=1e-5)
    assert handler.budget.used_bytes == 0
