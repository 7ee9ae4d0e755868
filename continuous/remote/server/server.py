"""A swarm server: holds a span of blocks, announces it in the DHT, serves sessions.

Run it as ``python -m continuous.remote.server --model PATH --blocks START:END --new-swarm``
(or ``--initial-peers MADDR ...`` to join a swarm). When it is ready it prints the
multiaddress that others join with on a line of its own.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from pathlib import Path

import torch
from hivemind.dht.node import DHTNode
from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2
from hivemind.utils import get_dht_time

from continuous.remote.server.blocks import Blocks
from continuous.remote.server.handler import InferenceHandler
from continuous.remote.server.memory import MemoryBudget
from continuous.remote.wire.protocol import (
    INFERENCE_HANDLER,
    INFO_HANDLER,
    OFFLINE,
    ONLINE,
    block_key,
    default_dht_prefix,
    pack,
)

logger = logging.getLogger(__name__)



class Server:
    """A server of blocks ``start:end`` of the model at ``model_path``.

    Parameters
    ----------
    model_path
        Directory of the model (config and safetensors weights).
    start, end
        The blocks it serves, ``end`` excluded.
    initial_peers
        Multiaddresses of peers of the swarm to join; none starts a new swarm.
    host, port
        Where to listen (port 0: any free port).
    cache_bytes
        Budget of attention cache for all sessions together.
    max_length
        Longest session accepted.
    session_timeout
        Seconds a session may stay idle before it is closed.
    dht_prefix
        Name the blocks are announced under (default: the model directory's name).
    dtype
        Dtype of weights, compute and cache.
    update_period
        Seconds between two announcements in the DHT.
    open_timeout
        Seconds a new stream has to open its session.
    max_streams_per_peer
        Streams one peer may hold at once.
    """

    def __init__(self, model_path: str | Path, start: int, end: int, *, initial_peers: list[str] = (),
                 host: str = "127.0.0.1", port: int = 0, cache_bytes: int = 2**30, max_length: int = 2048,
                 session_timeout: float = 300.0, dht_prefix: str | None = None, dtype: str = "float32",
                 update_period: float = 10.0, open_timeout: float = 5.0, max_streams_per_peer: int = 64):
        self.blocks = Blocks(model_path, start, end, getattr(torch, dtype))
        self.max_length = min(max_length, self.blocks.max_position)
        self.budget = MemoryBudget(cache_bytes)
        self.initial_peers = list(initial_peers)
        self.host, self.port = host, port
        self.dht_prefix = dht_prefix or default_dht_prefix(model_path)
        self.update_period = update_period
        self.handler = InferenceHandler(self.blocks, self.budget, self.max_length, session_timeout,
                                        on_change=self._changed, open_timeout=open_timeout,
                                        max_streams_per_peer=max_streams_per_peer)
        self.p2p: P2P | None = None
        self.dht: DHTNode | None = None
        self._changed_event: asyncio.Event | None = None
        self._announcer: asyncio.Task | None = None

    def _changed(self) -> None:
        if self._changed_event is not None:
            self._changed_event.set()

    def info(self, state: str = ONLINE) -> dict:
        """What the server announces: its state, blocks and free cache."""
        return {
            "state": state, "start": self.blocks.start, "end": self.blocks.end,
            "free_bytes": self.budget.free_bytes, "max_length": self.max_length,
            "token_bytes": self.blocks.cache_nbytes(1, 1, 1),  # per block, row and token
            # Forwards run and the steps they served: how much concurrent sessions are batched.
            "forwards": self.handler.batcher.batches, "steps": self.handler.batcher.steps,
        }

    async def start(self) -> list[str]:
        """Join the swarm, register the handlers and announce the blocks; return our multiaddresses."""
        self._changed_event = asyncio.Event()
        self._warm_up()
        self.p2p = await P2P.create(initial_peers=self.initial_peers,
                                    host_maddrs=[f"/ip4/{self.host}/tcp/{self.port}"])
        self.dht = await DHTNode.create(p2p=self.p2p, initial_peers=self.initial_peers)
        await self.p2p.add_binary_stream_handler(INFERENCE_HANDLER, self.handler)
        await self.p2p.add_protobuf_handler(INFO_HANDLER, self._rpc_info, runtime_pb2.ExpertUID)
        await self._announce(ONLINE)
        self._announcer = asyncio.create_task(self._announce_loop())
        return [str(m) for m in await self.p2p.get_visible_maddrs()]

    def _warm_up(self) -> None:
        # The first forward of a process is slow (allocator, thread pool): pay it before
        # announcing, not in the first session, which may be a failover waiting for us.
        b = self.blocks
        cache = b.new_cache(b.start, b.end, 4, MemoryBudget(2**40))
        b.step(cache, b.start, b.end, torch.zeros(1, 2, b.hidden_size), 0, None, None, None)
        b.step(cache, b.start, b.end, torch.zeros(1, 1, b.hidden_size), 2, None, None, None)

    async def _rpc_info(self, request: runtime_pb2.ExpertUID, context) -> runtime_pb2.ExpertInfo:
        return runtime_pb2.ExpertInfo(serialized_info=pack(self.info()))

    async def _announce(self, state: str, timeout: float = 10) -> None:
        info = self.info(state)
        keys = [block_key(self.dht_prefix, i) for i in range(self.blocks.start, self.blocks.end)]
        expiration = get_dht_time() + 3 * self.update_period
        subkey = self.p2p.peer_id.to_base58()
        try:
            await asyncio.wait_for(self.dht.store_many(keys, [info] * len(keys), expiration,
                                                       subkeys=[subkey] * len(keys)), timeout)
        except Exception as e:
            logger.warning("announcing in the DHT failed: %r", e)

    async def _announce_loop(self) -> None:
        # Every update_period, and sooner when the free cache changed: not after every step,
        # which under load would keep the DHT (ours and our peers') busy for nothing.
        announced, last = self.budget.free_bytes, asyncio.get_running_loop().time()
        while True:
            try:
                await asyncio.wait_for(self._changed_event.wait(),
                                       max(0.0, last + self.update_period - asyncio.get_running_loop().time()))
            except asyncio.TimeoutError:
                pass
            self._changed_event.clear()
            now = asyncio.get_running_loop().time()
            if self.budget.free_bytes != announced or now >= last + self.update_period:
                announced, last = self.budget.free_bytes, now
                await self._announce(ONLINE)

    async def shutdown(self) -> None:
        """Leave the DHT, close the sessions, stop the daemon (each stage bounded in time)."""
        logger.info("shutting down")
        if self._announcer is not None:
            self._announcer.cancel()
        if self.dht is not None:
            await self._announce(OFFLINE, timeout=3)
        await self.handler.shutdown()
        for stage in (self.dht, self.p2p):
            if stage is not None:
                try:
                    await asyncio.wait_for(stage.shutdown(), 3)
                except Exception as e:
                    logger.warning("shutdown of %s: %r", type(stage).__name__, e)
        logger.info("stopped")


async def _serve(args: argparse.Namespace) -> None:
    server = Server(args.model, args.start, args.end, initial_peers=args.initial_peers or [], host=args.host,
                    port=args.port, cache_bytes=args.cache_bytes, max_length=args.max_length,
                    session_timeout=args.session_timeout, dht_prefix=args.dht_prefix, dtype=args.dtype,
                    update_period=args.update_period, open_timeout=args.open_timeout,
                    max_streams_per_peer=args.max_streams_per_peer)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    # The libp2p daemon inherits an *ignored* SIGINT: a Ctrl-C in the terminal (sent to the
    # whole process group) then stops only this process, which can still leave the DHT
    # and close its sessions through the daemon before stopping it.
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        maddrs = await server.start()
    finally:
        signal.signal(signal.SIGINT, previous)
        loop.add_signal_handler(signal.SIGINT, stop.set)
    try:
        ready = [m for m in maddrs if f"/{args.host}/" in m] or maddrs
        print(ready[0], flush=True)  # the ready line: what other peers join with
        logger.info("serving blocks %d:%d of %s as %s", args.start, args.end, server.dht_prefix, ready[0])
        await stop.wait()
    finally:
        await server.shutdown()


def run(args: argparse.Namespace) -> None:
    """Serve as ``python -m continuous.remote.server`` asked (its arguments parsed), until SIGTERM or Ctrl-C."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(max(1, args.threads or torch.get_num_threads()))
    asyncio.run(_serve(args))
