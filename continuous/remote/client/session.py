"""Inference sessions over a chain of servers, with failover by replay.

An :class:`InferenceSession` is made of one :class:`ServerSession` per span of blocks
(one libp2p stream to one server each). For every span it keeps the *history*: the
input hidden states of the positions the servers currently hold, already cut by
rewinds and reordered by ``hypo_ids``. When a server fails or leaves, the client routes
a replacement for that span, replays the history there in one step, and goes on: the
new server's cache is then the one the old server had, so the output does not change.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import torch
from hivemind.proto import runtime_pb2

from continuous.remote.client.routing import Hop, SwarmClient, loop_alive, run
from continuous.remote.wire.protocol import (
    INFERENCE_HANDLER,
    MAX_CONTROL_BYTES,
    BadRequestError,
    MaxLengthError,
    RemoteError,
    ServerFaultError,
    SessionTimeoutError,
    raise_for_error,
    read_message,
    write_message,
)

logger = logging.getLogger(__name__)

_COMPRESSIONS = {"none": runtime_pb2.CompressionType.NONE, "float16": runtime_pb2.CompressionType.FLOAT16}


class ServerSession:
    """A session on one server for blocks ``hop.start:hop.end``: one stream, one server-side cache.

    It sends what it is given and leaves all checks to the server (and to
    :class:`InferenceSession`). Every call is bounded by a timeout.

    Parameters
    ----------
    swarm
        The swarm client (its daemon opens the stream).
    hop
        The server and the blocks.
    max_length, batch_size
        The session's size, reserved on the server when it opens.
    idle_timeout
        Ask the server to close the session after this many idle seconds (it may choose less).
    step_timeout
        Longest wait for a step's reply, in seconds.
    compression
        ``"none"`` or ``"float16"`` for the hidden states, both ways.
    """

    def __init__(self, swarm: SwarmClient, hop: Hop, max_length: int, batch_size: int, *,
                 idle_timeout: float | None = None, step_timeout: float = 60.0, compression: str = "none",
                 hidden_size: int = 2**14):
        self.swarm, self.hop = swarm, hop
        self.peer = hop.server.peer_id
        self.max_length, self.batch_size = max_length, batch_size
        self.idle_timeout, self.step_timeout = idle_timeout, step_timeout
        self.compression = _COMPRESSIONS[compression]
        self._reply_bytes = batch_size * max_length * hidden_size * 4 + MAX_CONTROL_BYTES
        self._writer = None
        self._replies: asyncio.Queue | None = None
        self._reading: asyncio.Task | None = None
        self._broken: str | None = None

    def __repr__(self):
        return f"ServerSession({self.peer.to_base58()[-6:]}, blocks {self.hop.start}:{self.hop.end})"

    def open(self) -> "ServerSession":
        """Open the stream and reserve the session on the server."""
        self._call(self._open(), self.swarm.timeout, "opening a session")
        return self

    async def _open(self) -> None:
        _, reader, self._writer = await self.swarm.p2p.call_binary_stream_handler(self.peer, INFERENCE_HANDLER)
        await write_message(self._writer, {
            "type": "open", "start": self.hop.start, "end": self.hop.end, "max_length": self.max_length,
            "batch_size": self.batch_size, "timeout": self.idle_timeout,
        })
        metadata, _ = await read_message(reader, MAX_CONTROL_BYTES, timeout=None, response=True)
        raise_for_error(metadata, self.peer.to_base58())
        self._replies = asyncio.Queue()
        self._reading = asyncio.create_task(self._read_replies(reader))

    async def _read_replies(self, reader: asyncio.StreamReader) -> None:
        # Read all the time, not only after a request: a reply the server sends on its own
        # (session timeout, shutdown) is then at hand even if writing the next request fails.
        try:
            while True:
                await self._replies.put(await read_message(reader, self._reply_bytes, timeout=None, response=True))
        except asyncio.IncompleteReadError:
            await self._replies.put(RemoteError(f"connection to {self} lost"))
        except RemoteError as e:
            # Whatever the reader refused (too large, undecodable) is the server's fault, not
            # the request's: the session fails over to another server instead of ending.
            await self._replies.put(ServerFaultError(f"{self} sent a malformed reply: {e}"))
        except Exception as e:
            await self._replies.put(RemoteError(f"connection to {self} failed: {e!r}"))

    def step(self, hidden_states: torch.Tensor, start_position: int, hypo_ids: torch.Tensor | None = None,
             attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Send one step; return the hidden states after the span's blocks."""
        return run(self.step_async(hidden_states, start_position, hypo_ids, attention_mask, position_ids), None)

    async def step_async(self, hidden_states: torch.Tensor, start_position: int,
                         hypo_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                         position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`step` in the event loop of the swarm client, with the same timeout and errors."""
        if self._writer is None or self._broken:
            raise RemoteError(f"{self} is closed" + (f" ({self._broken})" if self._broken else ""))
        names, tensors = ["hidden_states"], [hidden_states]
        for name, tensor in (("hypo_ids", hypo_ids), ("attention_mask", attention_mask),
                             ("position_ids", position_ids)):
            if tensor is not None:
                names.append(name)
                tensors.append(tensor)
        metadata = {"type": "step", "start_position": int(start_position), "tensors": names,
                    "compression": int(self.compression)}
        return await self._guarded(self._step(metadata, tensors), self.step_timeout, "a step")

    async def _step(self, metadata: dict, tensors: list[torch.Tensor]) -> torch.Tensor:
        write_error = None
        try:
            await write_message(self._writer, metadata, tensors, compression=self.compression)
        except (ConnectionError, OSError) as e:
            write_error = e  # the server may have closed the stream after an error: read it
        reply = await self._replies.get()
        if isinstance(reply, BaseException):
            self._broken = str(reply)
            raise reply from write_error
        metadata, out = reply
        raise_for_error(metadata, self.peer.to_base58())
        if (metadata.get("ok") is not True or len(out) != 1 or out[0].shape != tensors[0].shape
                or not out[0].is_floating_point()):
            self._broken = "malformed reply"
            raise ServerFaultError(f"{self} replied with a malformed step: {metadata!r}, "
                                   f"{[(t.dtype, list(t.shape)) for t in out]}")
        return out[0].to(tensors[0].dtype)

    def _call(self, coro, timeout: float, what: str):
        return run(self._guarded(coro, timeout, what), None)

    async def _guarded(self, coro, timeout: float, what: str):
        """Await ``coro`` within ``timeout`` seconds; any failure is a :class:`RemoteError`."""
        try:
            return await asyncio.wait_for(coro, timeout)
        except RemoteError:
            raise
        except (TimeoutError, asyncio.TimeoutError):  # distinct before Python 3.11
            # A late reply would answer the wrong request: this stream is done.
            self._broken = f"no reply to {what} within {timeout:.0f} s"
            raise RemoteError(f"{self}: {self._broken}") from None
        except Exception as e:
            self._broken = f"{what} failed: {e!r}"
            raise RemoteError(f"{self}: {self._broken}") from e

    def close(self) -> None:
        """Tell the server the session is over (best effort) and close the stream."""
        writer, reading, self._writer, self._reading = self._writer, self._reading, None, None
        if writer is None:
            return

        async def close():
            try:
                await asyncio.wait_for(write_message(writer, {"type": "close"}), 2)
            finally:
                writer.close()
                if reading is not None:
                    reading.cancel()

        try:
            run(close(), 3)
        except Exception:
            pass


@dataclass
class _Span:
    """Blocks ``start:end``, the server session that holds them and their input history."""

    start: int
    end: int
    server: ServerSession | None = None
    inputs: torch.Tensor | None = None  # [rows, position, hidden] of the positions the servers hold
    synced: bool = True  # whether the server holds exactly the committed history
    # The storage ``inputs`` is a prefix of, with room to append, when this span alone holds
    # it: a step then writes its inputs in place instead of copying the whole history.
    room: torch.Tensor | None = None

    def commit(self, start: int, hypo_ids: torch.Tensor | None, new: torch.Tensor, max_length: int) -> None:
        """The history becomes its first ``start`` positions (rows ``hypo_ids``) followed by ``new``."""
        end = start + new.shape[1]
        room = self.room
        if (room is None or hypo_ids is not None or room.shape[0] != new.shape[0] or room.shape[1] < end
                or room.dtype != new.dtype):
            room = new.new_empty(new.shape[0], min(max_length, max(2 * end, 64)), new.shape[2])
            if start > 0:
                room[:, :start] = self.inputs[:, :start] if hypo_ids is None else self.inputs[hypo_ids, :start]
            self.room = room
        room[:, start:end] = new
        self.inputs = room[:, :end]


class InferenceSession:
    """A session through the whole chain of blocks: hidden states in, hidden states out.

    The caches stay on the servers between steps. ``position`` is the number of
    positions they hold; assigning a smaller value rewinds (the next step overwrites
    the positions after it). Servers are chosen, and opened, at the first step.

    Parameters
    ----------
    swarm
        The swarm client of the model.
    max_length
        Most positions the session will hold; checked before any compute.
    hidden_size
        Hidden size of the model (checked before sending).
    batch_size
        Most rows a step may have; by default the rows of the first step.
    idle_timeout
        Ask servers to drop the session after this many idle seconds (a later step
        then replays the history on a fresh session).
    step_timeout
        Longest wait for one server's reply to a step.
    max_retries
        Failed attempts tolerated per span and step before giving up.
    compression
        ``"none"`` (exact) or ``"float16"`` for hidden states on the wire.
    replay_chunk
        Most positions one step of a replay (after a failover) sends.
    """

    def __init__(self, swarm: SwarmClient, max_length: int, *, hidden_size: int, batch_size: int | None = None,
                 idle_timeout: float | None = None, step_timeout: float = 60.0, max_retries: int = 3,
                 compression: str = "none", replay_chunk: int = 256):
        if compression not in _COMPRESSIONS:
            raise ValueError(f"compression must be one of {sorted(_COMPRESSIONS)}")
        self.swarm, self.max_length, self.hidden_size = swarm, int(max_length), hidden_size
        self.batch_size = batch_size
        self.idle_timeout, self.step_timeout = idle_timeout, step_timeout
        self.max_retries, self.compression = max_retries, compression
        if replay_chunk < 1:
            raise ValueError(f"replay_chunk must be positive, got {replay_chunk}")
        self.replay_chunk = replay_chunk
        self._spans: list[_Span] = []
        self._position = 0
        self._rows = 0
        self._positions: torch.Tensor | None = None  # [rows, position] RoPE positions of the history
        self._mask: torch.Tensor | None = None  # [rows, position] bool, if a mask was ever given
        self._closed = False

    # -- public -------------------------------------------------------------------------

    @property
    def position(self) -> int:
        """Number of positions held by the servers; assign a smaller value to rewind."""
        return self._position

    @position.setter
    def position(self, value: int) -> None:
        if not 0 <= value <= self._position:
            raise ValueError(f"can only rewind: position must be in [0, {self._position}], got {value}")
        self._position = int(value)

    @property
    def rows(self) -> int:
        """Number of rows the servers' caches hold."""
        return self._rows

    @property
    def servers(self) -> list[tuple[str, int, int]]:
        """The current chain: (peer id, first block, end block) for each span."""
        return [(s.server.peer.to_base58() if s.server else "", s.start, s.end) for s in self._spans]

    def step(self, hidden_states: torch.Tensor, hypo_ids: torch.Tensor | None = None, *,
             start_position: int | None = None, attention_mask: torch.Tensor | None = None,
             position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Run new positions through all blocks.

        Parameters
        ----------
        hidden_states
            [rows, n, hidden_size] inputs of the first block (the embeddings).
        hypo_ids
            [rows] int64: row ``i`` of this step continues row ``hypo_ids[i]`` of the cache
            (reorder, select, or fork by repeating an index).
        start_position
            Position of the first new token (default: :attr:`position`); positions
            from it on are dropped first. Must not exceed :attr:`position`.
        attention_mask
            [rows, start_position + n] of 0/1: which positions each row may attend to
            (always itself too). Once given it stays: later steps without one extend
            it with ones.
        position_ids
            [rows, n] RoPE positions of the new tokens (default: consecutive from
            ``start_position``).

        Returns
        -------
        torch.Tensor
            [rows, n, hidden_size], the output of the last block.

        Raises
        ------
        MaxLengthError
            ``start_position + n > max_length`` (before any compute).
        BadRequestError
            Inconsistent shapes or indices.
        RemoteError
            The swarm could not run the step after ``max_retries`` failovers.
        """
        start, hypo_ids = self._check_step(hidden_states, hypo_ids, start_position)
        rows, n = hidden_states.shape[:2]
        new_positions = (torch.arange(start, start + n).expand(rows, n) if position_ids is None
                         else torch.as_tensor(position_ids, dtype=torch.int64).cpu())
        if new_positions.shape != (rows, n):
            raise BadRequestError(f"position_ids must be [{rows}, {n}], got {list(new_positions.shape)}")
        positions, mask = self._history(start, rows, n, hypo_ids, new_positions, attention_mask)
        args = (start, hypo_ids, mask, None if position_ids is None else new_positions)
        x = self._run(hidden_states.detach().cpu(), args)
        self._positions, self._mask, self._rows, self._position = positions, mask, rows, start + n
        return x.to(device=hidden_states.device, dtype=hidden_states.dtype)

    def _check_step(self, hidden_states: torch.Tensor, hypo_ids, start_position) -> tuple[int, torch.Tensor | None]:
        """Refuse, before any compute, a step that does not fit the session; its start and row selection."""
        if self._closed:
            raise RuntimeError("the inference session is closed")
        start = self._position if start_position is None else int(start_position)
        if not 0 <= start <= self._position:
            raise BadRequestError(f"start_position must be in [0, {self._position}], got {start}")
        if hidden_states.ndim != 3 or hidden_states.shape[2] != self.hidden_size:
            raise BadRequestError(f"hidden_states must be [rows, n, {self.hidden_size}], got "
                                  f"{list(hidden_states.shape)}")
        rows, n = hidden_states.shape[:2]
        if start + n > self.max_length:
            raise MaxLengthError(f"max_length exceeded: {start} positions held + {n} new > max_length "
                                 f"{self.max_length} of the session")
        if self.batch_size is None:
            self.batch_size = rows
        if not 1 <= rows <= self.batch_size or n < 1:
            raise BadRequestError(f"a step has 1 to {self.batch_size} rows (batch_size) and at least one token, "
                                  f"got {list(hidden_states.shape)}")
        if start == 0:
            return start, None  # nothing cached to select from
        if hypo_ids is not None:
            hypo_ids = torch.as_tensor(hypo_ids, dtype=torch.int64).cpu()
            if hypo_ids.shape != (rows,) or hypo_ids.min() < 0 or hypo_ids.max() >= self._rows:
                raise BadRequestError(f"hypo_ids must be [{rows}] indices in [0, {self._rows})")
        elif rows != self._rows:
            raise BadRequestError(f"the step has {rows} rows but the session {self._rows}: pass hypo_ids")
        return start, hypo_ids

    def _history(self, start: int, rows: int, n: int, hypo_ids, new_positions, attention_mask):
        """The positions and mask of the session's history after the step (rows selected)."""
        def keep(t: torch.Tensor) -> torch.Tensor:  # the history a step keeps, rows selected
            return t[:, :start] if hypo_ids is None else t[hypo_ids, :start]

        positions = new_positions if start == 0 else torch.cat([keep(self._positions), new_positions], 1)
        if attention_mask is not None:
            mask = torch.as_tensor(attention_mask).cpu().bool()
            if mask.shape != (rows, start + n):
                raise BadRequestError(f"attention_mask must be [{rows}, {start + n}], got {list(mask.shape)}")
        elif self._mask is not None and start > 0:
            mask = torch.cat([keep(self._mask), torch.ones(rows, n, dtype=torch.bool)], 1)
        else:
            mask = None
        return positions, mask

    def _run(self, x: torch.Tensor, args: tuple) -> torch.Tensor:
        """Run the step's inputs through every span, failing over where a server fails; commit it."""
        start, hypo_ids = args[0], args[1]
        if not self._spans:
            self._spans = [_Span(0, self.swarm.num_blocks)]
        # Usually every span has a live server in sync: the whole chain then runs in one call
        # of the event loop, each reply sent on to the next span from there rather than from
        # this thread, which under load may wait for a core between two spans.
        outs, failed = self._chain(x, *args)
        inputs = [x] + outs
        i = len(outs)
        while i < len(self._spans):  # failover, or servers still to open: span by span
            inputs.append(self._step_span(i, inputs[i], *args, failed=failed))
            self._spans[i].synced = False  # ahead of the committed history until the whole step succeeds
            failed = None
            i += 1
        for span, span_inputs in zip(self._spans, inputs):
            span.commit(start, hypo_ids, span_inputs, self.max_length)
            span.synced = True
        return inputs[-1]

    def fork(self) -> "InferenceSession":
        """A new, independent session with the same history (position, rows, caches).

        Nothing is sent now: at its first step the fork routes its own servers and
        replays the history there, as after a failure. Both sessions then go their ways.
        """
        if self._closed:
            raise RuntimeError("the inference session is closed")
        fork = InferenceSession(self.swarm, self.max_length, hidden_size=self.hidden_size,
                                batch_size=self.batch_size, idle_timeout=self.idle_timeout,
                                step_timeout=self.step_timeout, max_retries=self.max_retries,
                                compression=self.compression, replay_chunk=self.replay_chunk)
        # The two sessions share the histories, which neither may then write in place.
        fork._spans = [_Span(span.start, span.end, None, span.inputs) for span in self._spans]
        for span in self._spans:
            span.room = None
        fork._position, fork._rows, fork._positions, fork._mask = (self._position, self._rows, self._positions,
                                                                   self._mask)
        return fork

    def close(self) -> None:
        """Close the sessions on all servers (their caches are freed)."""
        if not self._closed:
            self._closed = True
            for span in self._spans:
                if span.server is not None:
                    span.server.close()
                    span.server = None

    def __enter__(self) -> "InferenceSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            if loop_alive():
                self.close()
        except Exception:
            pass

    # -- failover -------------------------------------------------------------------------

    def _chain(self, x, start, hypo_ids, mask, position_ids) -> tuple[list[torch.Tensor], RemoteError | None]:
        """Step the spans in order in one call of the event loop, while their servers are open
        and in sync; return the outputs of those that answered, and the error that stopped it."""
        outs: list[torch.Tensor] = []

        async def chain():
            h = x
            for span in self._spans:
                if span.server is None or not span.synced:
                    return
                h = await span.server.step_async(h, start, hypo_ids, mask, position_ids)
                span.synced = False  # ahead of the committed history until the whole step succeeds
                outs.append(h)

        try:
            run(chain(), None)
        except RemoteError as e:
            return outs, e
        return outs, None

    def _step_span(self, i: int, x, start, hypo_ids, mask, position_ids, failed: RemoteError | None = None
                   ) -> torch.Tensor:
        """Step span ``i``, failing over to other servers; ``failed``: the first attempt's error."""
        for attempt in range(self.max_retries + 1):
            span = self._spans[i]
            try:
                if failed is not None:
                    error, failed = failed, None
                    raise error
                if span.server is None:
                    self._replace(i)
                    span = self._spans[i]
                elif not span.synced:
                    self._replay(span.server, span.inputs)
                    span.synced = True
                return span.server.step(x, start, hypo_ids, mask, position_ids)
            except RemoteError as e:
                if not e.retryable or attempt == self.max_retries:
                    raise
                time.sleep(min(0.5 * (2**attempt - 1), 4.0))  # back off when the swarm is busy or changing
                logger.warning("blocks %d:%d failed (%s), attempt %d/%d: routing a replacement",
                               span.start, span.end, e, attempt + 1, self.max_retries)
                if span.server is not None:
                    if not isinstance(e, SessionTimeoutError):
                        self.swarm.ban(span.server.peer)
                    span.server.close()
                    span.server = None
        raise AssertionError("unreachable")

    def _replay(self, server: ServerSession, inputs: torch.Tensor | None) -> torch.Tensor | None:
        """Rebuild a server's cache from the committed history, from position 0.

        The history goes in steps of at most :attr:`replay_chunk` positions, so that each
        fits the step timeout and the server's limits however long the session is.
        """
        if inputs is None or self._position == 0:
            return None
        outs = []
        for a in range(0, self._position, self.replay_chunk):
            b = min(self._position, a + self.replay_chunk)
            outs.append(server.step(inputs[:, a:b], a, None, None if self._mask is None else self._mask[:, :b],
                                    self._positions[:, a:b]))
        return torch.cat(outs, 1)

    def _replace(self, i: int) -> None:
        """Route new servers for span ``i`` and replay its history through them."""
        old = self._spans[i]
        chain = self.swarm.route(old.start, old.end, self.batch_size, self.max_length)
        new, x = [], old.inputs
        try:
            for hop in chain:
                server = ServerSession(self.swarm, hop, self.max_length, self.batch_size,
                                       idle_timeout=self.idle_timeout, step_timeout=self.step_timeout,
                                       compression=self.compression, hidden_size=self.hidden_size)
                new.append(_Span(hop.start, hop.end, server, x))
                server.open()
                x = self._replay(server, x)
        except RemoteError:
            for span in new:
                span.server.close()
            if new:
                self.swarm.ban(new[-1].server.peer)
            raise
        if old.server is not None:
            old.server.close()
        self._spans[i : i + 1] = new
