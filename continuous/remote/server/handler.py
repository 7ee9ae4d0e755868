"""The server side of an inference session: one libp2p stream, one session, one cache.

The client opens a stream and sends an ``open`` message (the blocks it wants, the
session's ``max_length`` and ``batch_size``) within a short ``open_timeout``; the
server admits the session if its whole size could ever fit the budget, and then
charges the budget for what the session's cache holds as it grows. Each peer has at
most ``max_streams_per_peer`` streams open at once. Long steps run in chunks of
``chunk_tokens`` positions, each a separate job of the compute thread, so a long
prefill does not hold off the decode steps of other sessions for its whole length. Then each ``step`` message carries new hidden states and, in its
metadata, the ``start_position`` of the step (positions before it are kept, the rest
dropped); optional tensors ``hypo_ids``, ``attention_mask``, ``position_ids`` select
rows of the cache before the step, mask keys and place tokens for RoPE. Every value is
checked against the session before any compute. A session idle for longer than its
timeout is closed and its memory released.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass

import torch
from hivemind.proto import runtime_pb2

from continuous.remote.server.batcher import Batcher
from continuous.remote.server.blocks import Blocks, Step
from continuous.remote.server.memory import MemoryBudget, SessionCache
from continuous.remote.wire.protocol import (
    MAX_CONTROL_BYTES,
    AllocationError,
    BadRequestError,
    MaxLengthError,
    ProtocolError,
    RemoteError,
    ServerShutdownError,
    SessionTimeoutError,
    error_metadata,
    read_message,
    write_message,
)

logger = logging.getLogger(__name__)

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_REPLY_COMPRESSIONS = (runtime_pb2.CompressionType.NONE, runtime_pb2.CompressionType.FLOAT16)
_TENSOR_NAMES = ("hidden_states", "hypo_ids", "attention_mask", "position_ids")


@dataclass(eq=False)  # hashed by identity: the batcher tracks each session
class Session:
    start: int
    end: int
    max_length: int
    batch_size: int
    timeout: float
    cache: SessionCache | None = None

    def step_bytes(self, hidden_size: int) -> int:
        # The largest step: float32 hidden states, int64 mask and positions for every position.
        return self.batch_size * self.max_length * (hidden_size * 4 + 16) + MAX_CONTROL_BYTES


def _int(metadata: dict, key: str, low: int, high: int) -> int:
    value = metadata.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise BadRequestError(f"{key} must be an integer in [{low}, {high}], got {value!r}")
    return value


class InferenceHandler:
    """Serves inference streams over a span of blocks.

    Parameters
    ----------
    blocks
        The loaded blocks.
    budget
        The cache budget shared by the sessions.
    max_length
        Longest session the server accepts.
    session_timeout
        Longest idle time of a session, in seconds; a client may ask for less.
    on_change
        Called (in the event loop) when the free cache changes, to announce it.
    open_timeout
        Seconds a new stream has to send its ``open`` message.
    max_streams_per_peer
        Streams (sessions and streams still opening) one peer may hold at once.
    chunk_tokens
        Longest piece of a step run as one compute job.
    batch_window
        Slack, in seconds, on when the compute thread expects a mid-flight session's next step.
    """

    def __init__(self, blocks: Blocks, budget: MemoryBudget, max_length: int, session_timeout: float,
                 on_change=lambda: None, *, open_timeout: float = 5.0, max_streams_per_peer: int = 64,
                 chunk_tokens: int = 128, batch_window: float = 0.002):
        self.blocks, self.budget = blocks, budget
        self.max_length, self.session_timeout = max_length, session_timeout
        self.on_change = on_change
        self.open_timeout, self.max_streams_per_peer = open_timeout, max_streams_per_peer
        self.chunk_tokens = chunk_tokens
        self.streams: dict[str, int] = {}  # peer id -> streams open
        # One compute thread, off the event loop (the DHT and the streams keep being served
        # while a step computes), running concurrent sessions' steps as one forward.
        self.batcher = Batcher(blocks, window=batch_window)
        self.tasks: set[asyncio.Task] = set()
        self.closing = False

    async def __call__(self, stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self.tasks.add(task)
        peer = str(getattr(stream_info, "peer_id", ""))
        self.streams[peer] = self.streams.get(peer, 0) + 1
        session = None
        try:
            if self.streams[peer] > self.max_streams_per_peer:
                raise AllocationError(f"too many streams from one peer (limit {self.max_streams_per_peer})")
            session = await self._open(reader, writer)
            if session is not None:  # reserved: from here on, `finally` releases it
                await write_message(writer, {"ok": True, "timeout": session.timeout}, response=True)
                await self._serve(session, reader, writer)
        except asyncio.TimeoutError:
            await self._reply_error(writer, ProtocolError(f"no open message within {self.open_timeout} s"))
        except asyncio.CancelledError:
            await self._reply_error(writer, ServerShutdownError("the server is shutting down"))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client went away
        except Exception as e:
            logger.warning("inference stream failed: %r", e, exc_info=not isinstance(e, RemoteError))
            await self._reply_error(writer, e)
        finally:
            if session is not None:
                self.batcher.forget(session)
                session.cache.release()
                self.on_change()
            self.streams[peer] -= 1
            if not self.streams[peer]:
                del self.streams[peer]
            self.tasks.discard(task)
            writer.close()

    async def _reply_error(self, writer: asyncio.StreamWriter, error: BaseException) -> None:
        try:
            await asyncio.wait_for(write_message(writer, error_metadata(error), response=True), 2)
        except Exception:
            pass

    async def _open(self, reader, writer) -> Session | None:
        metadata, tensors = await read_message(reader, MAX_CONTROL_BYTES, timeout=self.open_timeout,
                                               frame_timeout=self.open_timeout)
        if metadata.get("type") != "open" or tensors:
            raise ProtocolError("the first message of a stream must open a session")
        if self.closing:
            raise ServerShutdownError("the server is shutting down")
        b = self.blocks
        try:
            start = _int(metadata, "start", b.start, b.end - 1)
            end = _int(metadata, "end", start + 1, b.end)
            batch_size = _int(metadata, "batch_size", 1, 2**16)
            max_length = metadata.get("max_length")
            if isinstance(max_length, int) and max_length > self.max_length:
                raise MaxLengthError(f"max_length {max_length} exceeds this server's limit of {self.max_length}")
            max_length = _int(metadata, "max_length", 1, self.max_length)
            timeout = metadata.get("timeout")
            if isinstance(timeout, (int, float)) and math.isfinite(timeout):
                timeout = min(max(float(timeout), 0.1), self.session_timeout)
            else:
                timeout = self.session_timeout
            # Admission: the session's worst case must fit the budget some day, and its
            # first allocation now; it is charged for what it holds as it grows.
            nbytes = b.cache_nbytes(end - start, batch_size, max_length)
            if nbytes > self.budget.max_bytes:
                raise AllocationError(f"session needs up to {nbytes} bytes of attention cache but the server's "
                                      f"budget is {self.budget.max_bytes} bytes")
            first = b.cache_nbytes(end - start, 1, min(max_length, SessionCache.MIN_LENGTH))
            if first > self.budget.free_bytes:
                raise AllocationError(f"session needs {first} bytes of attention cache to start but the server "
                                      f"has {self.budget.free_bytes} of {self.budget.max_bytes} bytes free")
        except RemoteError as e:
            await write_message(writer, error_metadata(e), response=True)
            return None
        session = Session(start, end, max_length, batch_size, timeout, b.new_cache(start, end, max_length,
                                                                                    self.budget))
        logger.info("opened session: blocks %d:%d, max_length %d, batch %d", start, end, max_length, batch_size)
        return session

    async def _serve(self, session: Session, reader, writer) -> None:
        while True:
            try:
                metadata, tensors = await read_message(
                    reader, session.step_bytes(self.blocks.hidden_size), timeout=session.timeout)
            except asyncio.TimeoutError:
                logger.info("session idle for more than %.1f s: closed", session.timeout)
                await self._reply_error(writer, SessionTimeoutError(
                    f"session closed after {session.timeout:.1f} s idle (session timeout)"))
                return
            except BadRequestError as e:  # too large, or a tensor that does not deserialize
                await write_message(writer, error_metadata(e), response=True)
                continue
            if metadata.get("type") == "close":
                return
            try:
                args = self._check_step(session, metadata, tensors)
            except BadRequestError as e:
                # The session is untouched: the client may fix its request and go on.
                await write_message(writer, error_metadata(e), response=True)
                continue
            try:
                out = await self._compute(session, *args)
            finally:
                self.on_change()  # the cache may have grown
            compression = metadata.get("compression") if metadata.get("compression") in _REPLY_COMPRESSIONS else 0
            await write_message(writer, {"ok": True}, [out], compression=compression, response=True)

    async def _compute(self, session: Session, hidden, start, hypo_ids, mask, positions) -> torch.Tensor:
        """Run a step in chunks of ``chunk_tokens`` positions, each its own compute job.

        The compute thread takes jobs in the order they come (batching those that fit
        together), so the decode steps of other sessions run between the chunks of a long
        prefill instead of after all of it. Attention is causal: chunks change nothing.
        """
        n, outs = hidden.shape[1], []
        for a in range(0, n, self.chunk_tokens):
            b = min(n, a + self.chunk_tokens)
            outs.append(await self.batcher.submit(session.start, session.end, Step(
                session.cache, hidden[:, a:b], start + a, hypo_ids if a == 0 else None,
                None if mask is None else mask[:, : start + b], None if positions is None else positions[:, a:b]),
                session))
        return outs[0] if len(outs) == 1 else torch.cat(outs, 1)

    def _check_step(self, session: Session, metadata: dict, tensors: list[torch.Tensor]):
        if metadata.get("type") != "step":
            raise BadRequestError(f"unknown message type {metadata.get('type')!r}")
        names = metadata.get("tensors")
        if (not isinstance(names, list) or len(names) != len(tensors) or not names
                or names[0] != "hidden_states" or len(set(names)) != len(names)
                or any(n not in _TENSOR_NAMES for n in names)):
            raise BadRequestError(f"a step carries hidden_states and optionally {_TENSOR_NAMES[1:]}, got {names!r}")
        named = dict(zip(names, tensors))
        cache = session.cache
        hidden = named["hidden_states"]
        start = _int(metadata, "start_position", 0, cache.length)
        if hidden.dtype not in _FLOATS or hidden.ndim != 3 or hidden.shape[2] != self.blocks.hidden_size:
            raise BadRequestError(f"hidden_states must be float [rows, n, {self.blocks.hidden_size}], got "
                                  f"{hidden.dtype} {list(hidden.shape)}")
        rows, n = hidden.shape[:2]
        if not 1 <= rows <= session.batch_size or n < 1:
            raise BadRequestError(f"a step has 1 to {session.batch_size} rows (the session's batch_size) and at "
                                  f"least one token, got shape {list(hidden.shape)}")
        if start + n > session.max_length:
            raise MaxLengthError(f"step of {n} tokens at position {start} exceeds the session's max_length "
                                 f"{session.max_length}")
        hypo_ids = named.get("hypo_ids")
        if hypo_ids is not None:
            if (hypo_ids.dtype != torch.int64 or hypo_ids.shape != (rows,)
                    or (start > 0 and (hypo_ids.min() < 0 or hypo_ids.max() >= cache.rows))):
                raise BadRequestError(f"hypo_ids must be int64 [{rows}] with values in [0, {cache.rows})")
        elif start > 0 and rows != cache.rows:
            raise BadRequestError(f"step has {rows} rows but the cache has {cache.rows}; pass hypo_ids to select")
        mask = named.get("attention_mask")
        if mask is not None:
            if mask.dtype not in (torch.bool, torch.int64, torch.int32, torch.uint8) or mask.shape != (rows, start + n):
                raise BadRequestError(f"attention_mask must be integer or bool [{rows}, {start + n}], got "
                                      f"{mask.dtype} {list(mask.shape)}")
            if ((mask != 0) & (mask != 1)).any():
                raise BadRequestError("attention_mask must hold only 0 and 1")
        positions = named.get("position_ids")
        if positions is not None:
            if positions.dtype != torch.int64 or positions.shape != (rows, n) or positions.min() < 0 \
                    or positions.max() >= 2**24:
                raise BadRequestError(f"position_ids must be int64 [{rows}, {n}] of non-negative positions")
        return hidden, start, hypo_ids, mask, positions

    async def shutdown(self) -> None:
        """Close every session (their clients get a ``shutdown`` error) and stop computing."""
        self.closing = True
        for task in list(self.tasks):
            task.cancel()
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=5)
        self.batcher.shutdown()
