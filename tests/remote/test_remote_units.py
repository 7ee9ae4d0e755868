"""The swarm's parts that need no swarm: wire format, routing, block loading."""

import asyncio

import pytest
import torch
from hivemind.p2p import PeerID
from hivemind.proto import runtime_pb2

from continuous.remote.client.routing import ServerInfo, best_chain, unserved
from continuous.remote.server.blocks import Blocks
from continuous.remote.wire.checkpoint import read_weights
from continuous.remote.wire.protocol import (
    MAX_FRAME_BYTES,
    BadRequestError,
    ProtocolError,
    deserialize,
    pack,
    read_message,
    serialize,
    write_message,
)

pytestmark = pytest.mark.timeout(60)


class _Pipe:
    """An in-memory stream: what the writer writes, the reader reads."""

    def __init__(self):
        self.reader = asyncio.StreamReader()

    def write(self, data):
        self.reader.feed_data(bytes(data))

    async def drain(self):
        pass


def _roundtrip(metadata, tensors, max_bytes, **kwargs):
    async def go():
        pipe = _Pipe()
        await write_message(pipe, metadata, tensors, **kwargs)
        return await read_message(pipe.reader, max_bytes, timeout=1)

    return asyncio.run(go())


def test_large_message_is_streamed_in_chunks():
    big = torch.randn(2, 700, 1024)  # 5.7 MB: more than hivemind's 4 MiB messages, several frames
    mask = torch.rand(2, 700) > 0.5
    metadata, (out, out_mask) = _roundtrip({"type": "step"}, [big, mask], 2**24)
    assert metadata["type"] == "step" and metadata["n_frames"] > 4
    assert torch.equal(out, big) and torch.equal(out_mask, mask)


def test_float16_compression():
    x = torch.randn(1, 3, 8)
    _, (out,) = _roundtrip({}, [x], 2**20, compression=runtime_pb2.CompressionType.FLOAT16)
    assert out.dtype == torch.float32 and torch.allclose(out, x, atol=1e-2)


def test_oversized_messages_are_refused_before_reading():
    async def go(frame_length):
        reader = asyncio.StreamReader()
        reader.feed_data(frame_length.to_bytes(8, "big"))  # a header, and no payload at all
        return await read_message(reader, 2**30, timeout=1)

    with pytest.raises(ProtocolError, match="exceeds"):
        asyncio.run(go(MAX_FRAME_BYTES + 1))
    with pytest.raises(BadRequestError, match="exceeds"):
        _roundtrip({}, [torch.randn(1, 300, 1024)], 2**20)  # 1.2 MB in a session limited to 1 MiB


def test_tensors_are_checked_before_deserializing():
    good = serialize(torch.randn(2, 3))
    for change in ({"dtype": "object"}, {"dtype": "float64"}, {"size": [2, 4]}, {"size": [1] * 5}):
        bad = runtime_pb2.Tensor()
        bad.CopyFrom(good)
        for key, value in change.items():
            if key == "size":
                del bad.size[:]
                bad.size.extend(value)
            else:
                setattr(bad, key, value)
        with pytest.raises(BadRequestError):
            deserialize(bad)


def test_metadata_is_plain_msgpack():
    # An extension type (which some serializers map to arbitrary objects) stays inert.
    import msgpack

    from continuous.remote.wire.protocol import unpack

    data = msgpack.packb({"x": msgpack.ExtType(42, b"\x80\x04payload")})
    assert isinstance(unpack(data)["x"], msgpack.ExtType)
    assert unpack(pack({"a": [1, 2]})) == {"a": [1, 2]}


def _server(name, start, end):
    return ServerInfo(PeerID(name.encode()), start, end, free_bytes=10**9, token_bytes=1, max_length=1024)


def test_best_chain_fewest_hops_then_latency():
    a, b, c, d = _server("a", 0, 4), _server("b", 4, 8), _server("c", 0, 8), _server("d", 0, 8)
    rtt = {a.peer_id: 0.001, b.peer_id: 0.001, c.peer_id: 0.5, d.peer_id: 0.2}
    assert [h.server for h in best_chain([a, b, c, d], 0, 8, rtt)] == [d]  # one hop beats faster two
    chain = best_chain([a, b], 0, 8, rtt)
    assert [(h.server, h.start, h.end) for h in chain] == [(a, 0, 4), (b, 4, 8)]
    # A part of a span: replacing blocks 2:6 uses servers past their own bounds only as needed.
    chain = best_chain([a, b], 2, 6, rtt)
    assert [(h.start, h.end) for h in chain] == [(2, 4), (4, 6)]
    assert best_chain([a], 0, 8, rtt) is None


def test_blocks_load_only_their_weights(swarm_model_dir):
    weights = read_weights(swarm_model_dir, ["model.layers.1."])
    assert weights and all(k.startswith("model.layers.1.") for k in weights)
    blocks = Blocks(swarm_model_dir, 1, 2)
    assert len(blocks.layers) == 1 and blocks.layers[0].self_attn.layer_idx == 1
    assert not any(p.is_meta for p in blocks.parameters())
    with pytest.raises(ValueError):
        Blocks(swarm_model_dir, 1, 3)


def test_a_missing_block_is_named():
    a, b = _server("a", 0, 1), _server("b", 2, 4)
    assert unserved([a, b], 0, 4, "tiny") == "no server for block 1 of tiny"
    assert unserved([a], 0, 6, "tiny") == "no server for blocks 1-5 of tiny"
    assert unserved([_server("c", 1, 2), _server("d", 3, 4)], 0, 5, "m") == "no server for blocks 0, 2, 4 of m"
    assert "each is announced" in unserved([a, b, _server("c", 1, 2)], 0, 4, "tiny")
