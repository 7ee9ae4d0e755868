"""The wire protocol of the swarm: framed messages, errors, DHT records.

A *message* is a dict of metadata plus a list of named tensors. It travels as one or
more *frames* over a libp2p stream: an 8-byte big-endian length followed by a protobuf
(`runtime_pb2.ExpertRequest` from the client, `ExpertResponse` from the server). The
first frame carries the metadata (msgpack, no extension types) and says how many
frames follow; tensors are serialized by hivemind (raw bytes or float16, never pickle)
and cut into chunks with `split_for_streaming`, so no frame is larger than
:data:`MAX_FRAME_BYTES`. A reader checks every declared length against its limits
*before* reading the payload, so an oversized message costs the server nothing.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any

import msgpack
import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.proto import runtime_pb2
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming

logger = logging.getLogger(__name__)

#: libp2p protocol names of the two handlers a server offers.
INFERENCE_HANDLER = "continuous.remote.inference"
INFO_HANDLER = "continuous.remote.info"

#: Tensor bytes per chunk, and the largest frame a reader accepts (chunk plus headers).
CHUNK_BYTES = 2**20
MAX_FRAME_BYTES = CHUNK_BYTES + 2**16
#: Frames of an oversized message that a reader drops before refusing it (more: it closes the stream).
MAX_DRAINED_FRAMES = 64
#: Largest metadata-only message (session opening, errors).
MAX_CONTROL_BYTES = 2**16

_HEADER = 8
_MAX_METADATA_BYTES = 2**14
_DTYPES = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "int64": torch.int64, "int32": torch.int32, "bool": torch.bool, "uint8": torch.uint8,
}
_COMPRESSIONS = {runtime_pb2.CompressionType.NONE, runtime_pb2.CompressionType.FLOAT16}

# Server states announced in the DHT.
ONLINE, OFFLINE = "online", "offline"


class RemoteError(RuntimeError):
    """An error reported by a server or met while talking to it.

    ``retryable`` says whether another server (or the same one, after a replay) may
    succeed where this one failed.
    """

    code = "internal"
    retryable = True


class BadRequestError(RemoteError, ValueError):
    """The request itself is wrong (shape, dtype, position): no server will accept it."""

    code = "bad_request"
    retryable = False


class MaxLengthError(BadRequestError):
    """A step would take the session past its ``max_length``."""

    code = "max_length"


class AllocationError(RemoteError):
    """A server (or every server) has no room in its cache budget for the session."""

    code = "allocation"


class SessionTimeoutError(RemoteError):
    """The server closed the session after it stayed idle longer than its timeout."""

    code = "timeout"


class ServerShutdownError(RemoteError):
    """The server is leaving the swarm."""

    code = "shutdown"


class ProtocolError(RemoteError):
    """A malformed or oversized message; the stream cannot be trusted any more."""

    code = "protocol"
    retryable = False


class ServerFaultError(RemoteError):
    """A server sent a malformed or oversized reply: the client stops trusting it for the session."""

    code = "server_fault"


_ERRORS = {cls.code: cls for cls in (RemoteError, BadRequestError, MaxLengthError, AllocationError,
                                     SessionTimeoutError, ServerShutdownError, ProtocolError, ServerFaultError)}


def error_metadata(error: BaseException) -> dict:
    """Metadata of the reply that reports ``error`` to the client."""
    code = error.code if isinstance(error, RemoteError) else "internal"
    return {"error": str(error) or type(error).__name__, "code": code}


def raise_for_error(metadata: dict, peer: str = "") -> None:
    """Raise the exception a reply describes, if it describes one."""
    if "error" in metadata:
        cls = _ERRORS.get(metadata.get("code"), RemoteError)
        where = f" (server {peer})" if peer else ""
        raise cls(f"{metadata['error']}{where}")


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes) -> Any:
    # Plain msgpack with no ext_hook: unknown extension types stay inert ExtType objects.
    return msgpack.unpackb(data, raw=False, strict_map_key=True, max_bin_len=_MAX_METADATA_BYTES,
                           max_str_len=_MAX_METADATA_BYTES, max_array_len=4096, max_map_len=256)


def serialize(tensor: torch.Tensor, compression: int = runtime_pb2.CompressionType.NONE) -> runtime_pb2.Tensor:
    """Serialize a tensor with hivemind; float16 compression only applies to float tensors."""
    if not tensor.is_floating_point():
        compression = runtime_pb2.CompressionType.NONE
    return serialize_torch_tensor(tensor.detach().cpu().contiguous(), compression)


def deserialize(proto: runtime_pb2.Tensor) -> torch.Tensor:
    """Deserialize a tensor after checking its dtype, compression and buffer size."""
    if proto.dtype not in _DTYPES or proto.compression not in _COMPRESSIONS:
        raise BadRequestError(f"unsupported tensor dtype {proto.dtype!r} or compression {proto.compression}")
    if len(proto.size) > 4:
        raise BadRequestError(f"tensors have at most 4 dimensions, got {len(proto.size)}")
    dtype = _DTYPES[proto.dtype]
    itemsize = 2 if proto.compression == runtime_pb2.CompressionType.FLOAT16 else dtype.itemsize
    if proto.compression == runtime_pb2.CompressionType.FLOAT16 and not dtype.is_floating_point:
        raise BadRequestError("float16 compression of a non-float tensor")
    if proto.dtype == "bfloat16" and len(proto.buffer) == 4 * math.prod(proto.size):
        itemsize = 4  # hivemind's legacy mode sends bfloat16 as float32
    if len(proto.buffer) != itemsize * math.prod(proto.size):
        raise BadRequestError(f"tensor buffer of {len(proto.buffer)} bytes does not match shape {list(proto.size)}")
    return deserialize_torch_tensor(proto).detach()


def _frames(metadata: dict, tensors: list[torch.Tensor], compression: int, response: bool) -> list[bytes]:
    parts = [part for t in tensors for part in split_for_streaming(serialize(t, compression), CHUNK_BYTES)]
    groups: list[list[runtime_pb2.Tensor]] = [[]]
    size = 0
    for part in parts:
        if groups[-1] and size + len(part.buffer) > CHUNK_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(part)
        size += len(part.buffer)
    metadata = dict(metadata, n_frames=len(groups))
    cls = runtime_pb2.ExpertResponse if response else runtime_pb2.ExpertRequest
    frames = []
    for i, group in enumerate(groups):
        frames.append(cls(tensors=group, metadata=pack(metadata) if i == 0 else b"").SerializeToString())
    return frames


async def write_message(writer: asyncio.StreamWriter, metadata: dict, tensors: list[torch.Tensor] = (),
                        *, compression: int = runtime_pb2.CompressionType.NONE, response: bool = False) -> None:
    """Send one message (metadata and tensors) as one or more frames."""
    # One write for the whole message: each write is a system call, and a step's reply is small.
    writer.write(b"".join(len(frame).to_bytes(_HEADER, "big") + frame
                          for frame in _frames(metadata, list(tensors), compression, response)))
    await writer.drain()


async def _read_frame(reader: asyncio.StreamReader, limit: int) -> bytes:
    length = int.from_bytes(await reader.readexactly(_HEADER), "big")
    if length > limit:
        raise ProtocolError(f"message frame of {length} bytes exceeds the limit of {limit} bytes")
    return await reader.readexactly(length)


async def read_message(reader: asyncio.StreamReader, max_bytes: int, *, timeout: float | None,
                       frame_timeout: float = 30.0, response: bool = False) -> tuple[dict, list[torch.Tensor]]:
    """Read one message, refusing it as soon as its declared size exceeds ``max_bytes``.

    Parameters
    ----------
    reader
        The stream.
    max_bytes
        Largest accepted message, all frames together.
    timeout
        Seconds to wait for the first frame (``asyncio.TimeoutError`` after that).
    frame_timeout
        Seconds to wait for each further frame.
    response
        Whether to parse server responses (else client requests).

    Raises
    ------
    asyncio.IncompleteReadError
        The other side closed the stream.
    ProtocolError
        The message is malformed or too large.
    """
    cls = runtime_pb2.ExpertResponse if response else runtime_pb2.ExpertRequest
    # Control messages are small; other messages may have frames of a whole chunk.
    first_limit = max_bytes if max_bytes <= MAX_CONTROL_BYTES else MAX_FRAME_BYTES
    first = await asyncio.wait_for(_read_frame(reader, first_limit), timeout)
    try:
        proto = cls.FromString(first)
        metadata = unpack(proto.metadata)
    except Exception as e:
        raise ProtocolError(f"malformed message: {e}") from None
    if not isinstance(metadata, dict) or not isinstance(metadata.get("n_frames", 1), int):
        raise ProtocolError("malformed message metadata")
    n_frames = metadata.get("n_frames", 1)
    if not 1 <= n_frames <= math.ceil(max_bytes / CHUNK_BYTES):
        if not 1 <= n_frames <= MAX_DRAINED_FRAMES:
            raise ProtocolError(f"message of {n_frames} frames exceeds the limit of {max_bytes} bytes")
        # Read and drop the rest (bounded): the stream stays usable and the sender, still
        # writing, can read why its message was refused.
        for _ in range(n_frames - 1):
            await asyncio.wait_for(_read_frame(reader, MAX_FRAME_BYTES), frame_timeout)
        raise BadRequestError(f"message of about {n_frames * CHUNK_BYTES} bytes exceeds the limit of {max_bytes} "
                              f"bytes of this session")
    parts = list(proto.tensors)
    total = len(first)
    for _ in range(n_frames - 1):
        frame = await asyncio.wait_for(_read_frame(reader, MAX_FRAME_BYTES), frame_timeout)
        total += len(frame)
        try:
            parts.extend(cls.FromString(frame).tensors)
        except Exception as e:
            raise ProtocolError(f"malformed message: {e}") from None
    if total > max_bytes:
        raise BadRequestError(f"message of {total} bytes exceeds the limit of {max_bytes} bytes of this session")
    tensors, current = [], []
    for part in parts:
        if part.dtype and current:  # a part that names a dtype starts a new tensor
            tensors.append(combine_from_streaming(current))
            current = []
        current.append(part)
    if current:
        tensors.append(combine_from_streaming(current))
    return metadata, [deserialize(t) for t in tensors]


def default_dht_prefix(model_path) -> str:
    """The name a model's blocks are announced under: the name of its directory."""
    from pathlib import Path

    return Path(model_path).resolve().name


def block_key(dht_prefix: str, block: int) -> str:
    """DHT key under which servers announce that they hold ``block``."""
    return f"{dht_prefix}.block.{block}"
