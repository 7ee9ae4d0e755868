"""Load, chaos and hostile input for a swarm: what ``benchmarks/swarm_load.py`` and the
tests drive. Nothing here is needed to use the swarm.

- :func:`greedy_clients`: concurrent clients, each a session decoding greedily, timed per step;
- :class:`Chaos`: kills a server every ``period`` seconds while its span has a spare,
  and starts a replacement;
- :func:`fuzz`: malformed frames from a hostile peer, each of which must be answered with
  an error or have its stream closed.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from hivemind.p2p import PeerID
from hivemind.proto import runtime_pb2

from continuous.remote.client.routing import run
from continuous.remote.wire.protocol import (
    INFERENCE_HANDLER,
    MAX_FRAME_BYTES,
    pack,
    read_message,
    write_message,
)

logger = logging.getLogger(__name__)


@torch.inference_mode()
def greedy(model, ids: torch.Tensor, n: int, latencies: list | None = None) -> torch.Tensor:
    """``n`` greedy tokens after ``ids`` [1, t] through the swarm, one session; step times go to ``latencies``."""
    with model.inference_session(max_length=ids.shape[1] + n, batch_size=ids.shape[0]) as session:
        x, out = ids, []
        for _ in range(n):
            started = time.perf_counter()
            hidden = session.step(model.embed(x))
            if latencies is not None:
                latencies.append(time.perf_counter() - started)
            x = model.logits(hidden[:, -1:]).argmax(-1)
            out.append(x)
    return torch.cat(out, 1)


def greedy_clients(model, prompts: list[torch.Tensor], n: int
                   ) -> tuple[list[torch.Tensor | None], list[float], float]:
    """Run one greedy client per prompt, all at once (threads).

    Returns
    -------
    (tokens, latencies, seconds)
        Each client's tokens (``None`` for a client whose session failed, the error
        logged), every step's latency, and the wall time of the whole.
    """
    latencies: list[float] = []

    def client(prompt):
        try:
            return greedy(model, prompt, n, latencies)
        except Exception as e:
            logger.warning("a client failed: %r", e)
            return None

    started = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(client, prompts))
    return outs, latencies, time.perf_counter() - started


class Chaos:
    """Every ``period`` seconds, kill a live server whose blocks have another live server,
    and start a replacement for the same blocks (in a background thread).

    Parameters
    ----------
    swarm
        A :class:`continuous.demo.swarm.Swarm`.
    period
        Seconds between kills.
    """

    def __init__(self, swarm, period: float, seed: int = 0):
        self.swarm, self.period = swarm, period
        self.killed: list[str] = []
        self._rng = random.Random(seed)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos", daemon=True)

    def __enter__(self) -> "Chaos":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=120)

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            live = [s for s in self.swarm.servers if s.alive() and s.maddr]
            victims = [s for s in live if sum(t.blocks == s.blocks for t in live) >= 2]
            if not victims:
                continue
            victim = self._rng.choice(victims)
            victim.kill()
            self.killed.append(victim.blocks)
            logger.info("chaos: killed a server of %s; starting a replacement", victim.blocks)
            try:
                self.swarm.start(victim.blocks)
            except RuntimeError as e:
                logger.warning("chaos: the replacement did not start: %s", e)


#: Kinds of malformed frames :func:`fuzz` sends.
FUZZ_KINDS = ("random_bytes", "truncated_msgpack", "wrong_shape", "wrong_dtype", "oversized", "no_session",
              "after_close", "open_flood")


def _frame(body: bytes) -> bytes:
    return len(body).to_bytes(8, "big") + body


def _bad_open(rng: random.Random) -> bytes:
    meta = pack({"type": "open", "start": 0, "end": 1, "max_length": 8, "batch_size": 1})
    return _frame(runtime_pb2.ExpertRequest(metadata=meta[: rng.randrange(1, len(meta))]).SerializeToString())


def fuzz(swarm_client, peer: PeerID, frames: int, hidden_size: int, start: int, end: int, seed: int = 0,
         timeout: float = 10.0) -> dict:
    """Send ``frames`` malformed frames to ``peer``; count those answered with an error or closed.

    Each frame goes on a stream of its own, or on an open session for the kinds that a
    session survives (wrong shape or dtype). A frame counts as answered when an error
    reply comes back, as closed when the stream ends, and as neither when nothing comes
    within ``timeout`` seconds.

    Returns
    -------
    dict
        ``frames``, ``answered_or_closed``, and per kind the frames sent.
    """
    rng = random.Random(seed)
    p2p = swarm_client.p2p
    open_msg = {"type": "open", "start": start, "end": end, "max_length": 16, "batch_size": 1}

    async def outcome(reader) -> bool:
        try:
            metadata, _ = await read_message(reader, 2**20, timeout=timeout, response=True)
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            return True  # closed
        except asyncio.TimeoutError:
            return False
        except Exception:
            return True  # the server's reply was cut by its closing the stream
        return "error" in metadata

    async def stream():
        _, reader, writer = await p2p.call_binary_stream_handler(peer, INFERENCE_HANDLER)
        return reader, writer

    async def opened():
        reader, writer = await stream()
        await write_message(writer, open_msg)
        metadata, _ = await read_message(reader, 2**16, timeout=timeout, response=True)
        return reader, writer, metadata

    async def one(kind: str) -> tuple[int, int]:
        """Frames of this kind sent, and how many of them were answered or closed."""
        if kind in ("wrong_shape", "wrong_dtype"):
            reader, writer, metadata = await opened()
            if "error" in metadata:
                writer.close()
                return 1, 1  # refused at open: answered
            shape = [1, 2, hidden_size + rng.randrange(1, 9)] if kind == "wrong_shape" else [1, 2, hidden_size]
            dtype = torch.float32 if kind == "wrong_shape" else rng.choice([torch.int64, torch.bool, torch.int32])
            sent = good = 0
            for _ in range(8):
                x = torch.zeros(shape, dtype=dtype)
                await write_message(writer, {"type": "step", "start_position": 0, "tensors": ["hidden_states"]},
                                    [x])
                sent += 1
                good += await outcome(reader)
            writer.close()
            return sent, good
        if kind == "after_close":
            reader, writer, metadata = await opened()
            await write_message(writer, {"type": "close"})
            try:
                await write_message(writer, {"type": "step", "start_position": 0, "tensors": ["hidden_states"]},
                                    [torch.zeros(1, 1, hidden_size)])
            except (ConnectionError, OSError):
                good = True  # the server had closed the stream already
            else:
                good = await outcome(reader)
            writer.close()
            return 1, good
        if kind == "open_flood":
            streams = [await stream() for _ in range(8)]
            good = 0
            for reader, writer in streams:
                await write_message(writer, open_msg)
            for reader, writer in streams:  # each open is either accepted or refused; none hangs
                try:
                    metadata, _ = await read_message(reader, 2**16, timeout=timeout, response=True)
                    good += metadata.get("ok") is True or "error" in metadata
                except (asyncio.IncompleteReadError, ConnectionError, OSError):
                    good += 1
                except Exception:
                    pass
            for _, writer in streams:
                writer.close()
            return len(streams), good
        reader, writer = await stream()
        if kind == "random_bytes":
            data = _frame(rng.randbytes(rng.randrange(1, 2000)))
        elif kind == "truncated_msgpack":
            data = _bad_open(rng)
        elif kind == "oversized":
            data = (MAX_FRAME_BYTES + rng.randrange(1, 2**30)).to_bytes(8, "big")
        else:  # no_session: a step on a stream that never opened a session
            data = b""
            await write_message(writer, {"type": "step", "start_position": 0, "tensors": ["hidden_states"]},
                                [torch.zeros(1, 1, hidden_size)])
        if data:
            writer.write(data)
            await writer.drain()
        good = await outcome(reader)
        writer.close()
        return 1, good

    counts = {k: 0 for k in FUZZ_KINDS}
    sent = answered = 0
    while sent < frames:
        kind = FUZZ_KINDS[sent % len(FUZZ_KINDS)] if sent < len(FUZZ_KINDS) else rng.choice(FUZZ_KINDS)
        try:
            n, good = run(one(kind), timeout * 10)
        except Exception as e:  # could not even open a stream: counts as neither
            logger.warning("fuzz: %s failed: %r", kind, e)
            n, good = 1, 0
        counts[kind] += n
        sent += n
        answered += good
    return {"frames": sent, "answered_or_closed": answered, "kinds": counts}


def budget_in_use(swarm_client, peers: list[PeerID], cache_bytes: int, wait: float = 10.0) -> int:
    """Bytes of cache the ``peers`` still hold, once their released sessions are counted (waits up to ``wait`` s)."""
    deadline = time.monotonic() + wait
    while True:
        used = sum(cache_bytes - swarm_client.info(p)["free_bytes"] for p in peers)
        if used == 0 or time.monotonic() > deadline:
            return used
        time.sleep(0.2)
