"""The client's view of the swarm: who serves which blocks, and the best chain of servers.

A :class:`SwarmClient` owns a libp2p daemon and a client-mode DHT node, both living in
one background event loop thread shared by every client of the process; its blocking
methods run coroutines there and never wait longer than their timeout.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Coroutine, Sequence

from hivemind.dht.node import DHTNode
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2

from continuous.remote.wire.protocol import (
    INFO_HANDLER,
    ONLINE,
    AllocationError,
    RemoteError,
    block_key,
    unpack,
)

logger = logging.getLogger(__name__)

_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def event_loop() -> asyncio.AbstractEventLoop:
    """The background event loop of the swarm clients of this process (started on first use)."""
    global _loop
    with _loop_lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="continuous-swarm", daemon=True).start()
        return _loop


#: Live clients, stopped when the program ends (see :func:`_stop_clients`).
_CLIENTS: "weakref.WeakSet[SwarmClient]" = weakref.WeakSet()


def _stop_clients() -> None:
    """Stop every client as the program ends, before the interpreter stops the thread pools
    the daemon's tasks use (stopped later, they would wait for those pools in vain)."""
    for client in list(_CLIENTS):
        client.shutdown(timeout=5)


threading._register_atexit(_stop_clients)  # runs before concurrent.futures' own exit hook


def loop_alive() -> bool:
    """Whether the background loop runs (it does not during interpreter shutdown)."""
    return _loop is not None and _loop.is_running()


def run(coro: Coroutine, timeout: float | None) -> Any:
    """Run ``coro`` in the background loop; cancel it and raise ``TimeoutError`` after ``timeout`` s."""
    # Timed here rather than with asyncio.wait_for in the loop: the loop, which every client
    # thread of the process shares, then runs one task per call instead of two.
    future = asyncio.run_coroutine_threadsafe(coro, event_loop())
    try:
        return future.result(timeout)
    except concurrent.futures.TimeoutError:
        future.cancel()
        raise


@dataclass(frozen=True)
class ServerInfo:
    """A server as announced in the DHT."""

    peer_id: PeerID
    start: int
    end: int
    free_bytes: int
    token_bytes: int
    max_length: int

    def needed_bytes(self, start: int, end: int, batch_size: int, max_length: int) -> int:
        return self.token_bytes * (end - start) * batch_size * max_length


@dataclass(frozen=True)
class Hop:
    """One link of a chain: blocks ``start:end`` on ``server``."""

    server: ServerInfo
    start: int
    end: int


class SwarmClient:
    """A connection to the swarm serving one model.

    Parameters
    ----------
    initial_peers
        Multiaddresses of one or more peers of the swarm.
    dht_prefix
        Name the model's blocks are announced under.
    num_blocks
        Number of blocks of the model.
    timeout
        Bound of each DHT look-up and ping, in seconds.
    ban_time
        Seconds a server that failed is left out of new routes.
    """

    def __init__(self, initial_peers: Sequence[str], dht_prefix: str, num_blocks: int, *, timeout: float = 15.0,
                 ban_time: float = 30.0):
        if not initial_peers:
            raise ValueError("initial_peers: give the multiaddress of at least one peer of the swarm")
        self.dht_prefix, self.num_blocks = dht_prefix, num_blocks
        self.timeout, self.ban_time = timeout, ban_time
        self._banned: dict[PeerID, float] = {}
        self._rtt: dict[PeerID, tuple[float, float]] = {}  # peer -> (seconds, measured at)
        self.p2p, self.dht = run(self._start(list(initial_peers)), timeout)
        _CLIENTS.add(self)

    @staticmethod
    async def _start(initial_peers: list[str]) -> tuple[P2P, DHTNode]:
        p2p = await P2P.create(initial_peers=initial_peers, dht_mode="client")
        try:
            dht = await DHTNode.create(p2p=p2p, initial_peers=initial_peers, client_mode=True)
        except BaseException:
            await p2p.shutdown()
            raise
        return p2p, dht

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the DHT node and the daemon of this client."""
        if self.dht is not None:
            dht, p2p, self.dht, self.p2p = self.dht, self.p2p, None, None

            async def stop():
                await dht.shutdown()
                if dht.cache_refresh_task is not None:  # hivemind leaves it pending otherwise
                    dht.cache_refresh_task.cancel()
                await p2p.shutdown()

            try:
                run(stop(), self.timeout if timeout is None else timeout)
            except Exception as e:
                logger.warning("swarm client shutdown: %r", e)

    def __del__(self):
        try:
            if loop_alive():
                self.shutdown()
        except Exception:
            pass

    def ban(self, peer_id: PeerID) -> None:
        """Leave ``peer_id`` out of routes for a while (it failed)."""
        self._banned[peer_id] = time.monotonic() + self.ban_time

    def servers(self, start: int = 0, end: int | None = None) -> list[ServerInfo]:
        """Online servers announcing any of the blocks ``start:end``, from the DHT."""
        end = self.num_blocks if end is None else end
        keys = [block_key(self.dht_prefix, i) for i in range(start, end)]
        found = run(self.dht.get_many(keys, sufficient_expiration_time=float("inf")), self.timeout)
        servers = {}
        for key in keys:
            record = found.get(key)
            if record is None or not isinstance(record.value, dict):
                continue
            for subkey, item in record.value.items():
                info = item.value
                try:
                    peer_id = PeerID.from_base58(subkey)
                    if info["state"] != ONLINE:
                        continue
                    servers[peer_id] = ServerInfo(peer_id, int(info["start"]), int(info["end"]),
                                                  int(info["free_bytes"]), int(info["token_bytes"]),
                                                  int(info["max_length"]))
                except Exception:
                    logger.debug("ignoring malformed DHT record %r: %r", subkey, info)
        return list(servers.values())

    def ping(self, peers: Sequence[PeerID], timeout: float = 3.0, max_age: float = 60.0) -> dict[PeerID, float]:
        """Round-trip times (seconds) of the peers that answer within ``timeout``; recent ones are cached."""
        now = time.monotonic()
        todo = [p for p in peers if p not in self._rtt or now - self._rtt[p][1] > max_age]

        async def ping_one(peer: PeerID):
            t0 = time.perf_counter()
            await asyncio.wait_for(self.p2p.call_protobuf_handler(
                peer, INFO_HANDLER, runtime_pb2.ExpertUID(), runtime_pb2.ExpertInfo), timeout)
            return time.perf_counter() - t0

        async def ping_all():
            return await asyncio.gather(*(ping_one(p) for p in todo), return_exceptions=True)

        if todo:
            for peer, rtt in zip(todo, run(ping_all(), timeout + 1)):
                if isinstance(rtt, BaseException):
                    self._rtt.pop(peer, None)
                    logger.info("server %s does not answer: %r", peer, rtt)
                    self.ban(peer)
                else:
                    self._rtt[peer] = (rtt, now)
        return {p: self._rtt[p][0] for p in peers if p in self._rtt}

    def info(self, peer_id: PeerID) -> dict:
        """What a server reports about itself (blocks, free cache...)."""
        reply = run(self.p2p.call_protobuf_handler(peer_id, INFO_HANDLER, runtime_pb2.ExpertUID(),
                                                   runtime_pb2.ExpertInfo), self.timeout)
        return unpack(reply.serialized_info)

    def route(self, start: int, end: int, batch_size: int, max_length: int) -> list[Hop]:
        """The chain of servers through blocks ``start:end``: fewest hops, then lowest latency.

        Servers that were banned, cannot hold the session in their free cache, accept
        shorter sessions or do not answer a ping are left out.

        Raises
        ------
        AllocationError
            Some blocks are served, but by no server that can hold the session.
        RemoteError
            No server (that answers) serves some of the blocks.
        """
        now = time.monotonic()
        self._banned = {p: t for p, t in self._banned.items() if t > now}
        announced = [s for s in self.servers(start, end) if s.peer_id not in self._banned]
        fitting = [s for s in announced if s.max_length >= max_length
                   and s.free_bytes >= s.needed_bytes(max(s.start, start), min(s.end, end), batch_size, max_length)]
        rtt = self.ping([s.peer_id for s in fitting])
        chain = best_chain([s for s in fitting if s.peer_id in rtt], start, end, rtt)
        if chain is None:
            if best_chain(announced, start, end, {}) is not None:
                error = AllocationError(
                    f"no server for blocks {start}:{end} can hold a session of {batch_size} rows x {max_length} "
                    f"tokens (not enough free attention cache, or a lower max_length)")
                error.retryable = False  # every server was considered
                raise error
            raise RemoteError(unserved(announced, start, end, self.dht_prefix))
        logger.info("route for blocks %d:%d: %s", start, end,
                    " -> ".join(f"{h.server.peer_id.to_base58()[-6:]}[{h.start}:{h.end}]" for h in chain))
        return chain


def unserved(servers: Sequence[ServerInfo], start: int, end: int, prefix: str) -> str:
    """Why no chain goes through blocks ``start:end``: the blocks no server holds, by number."""
    missing = [b for b in range(start, end) if not any(s.start <= b < s.end for s in servers)]
    if not missing:
        return f"no server that answers serves blocks {start}:{end} of {prefix} (each is announced)"
    spans: list[list[int]] = []  # runs of consecutive blocks: [first, last]
    for b in missing:
        if spans and spans[-1][1] == b - 1:
            spans[-1][1] = b
        else:
            spans.append([b, b])
    names = ", ".join(str(a) if a == z else f"{a}-{z}" for a, z in spans)
    return f"no server for block{'s' if len(missing) > 1 else ''} {names} of {prefix}"


def best_chain(servers: Sequence[ServerInfo], start: int, end: int,
               rtt: dict[PeerID, float]) -> list[Hop] | None:
    """Fewest hops, then lowest total latency, through blocks ``start:end`` (dynamic programming).

    A server may be used for any part of its span, so from block ``b`` each server
    holding ``b`` takes the chain to the end of its span (or to ``end``).
    """
    best: dict[int, tuple[int, float, list[Hop]]] = {start: (0, 0.0, [])}
    for block in range(start, end):
        if block not in best:
            continue
        hops, latency, chain = best[block]
        for server in servers:
            if server.start <= block < server.end:
                stop = min(server.end, end)
                cost = (hops + 1, latency + rtt.get(server.peer_id, 0.0))
                if stop not in best or cost < best[stop][:2]:
                    best[stop] = (*cost, chain + [Hop(server, block, stop)])
    return best[end][2] if end in best else None


