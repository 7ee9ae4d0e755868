"""Bad input and limits: each gets its clear error, and the server keeps serving others."""

import pytest
import torch
from support.waiting import wait_until
from swarm_helpers import CACHE_BYTES, SERVER_MAX_LENGTH

from continuous.remote import (
    AllocationError,
    BadRequestError,
    MaxLengthError,
    SessionTimeoutError,
)
from continuous.remote.client.routing import Hop
from continuous.remote.client.session import ServerSession

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]  # the first test also starts the swarm

HIDDEN = 64


def _open(remote_model, swarm, max_length=16, batch_size=1, **kwargs) -> ServerSession:
    """A session on one live server of blocks 0:1, without any check on the client side."""
    # The DHT may still list servers that the failover tests killed: pick a running one.
    server = next(s for s in remote_model.swarm.servers(0, 1) if swarm.by_peer(s.peer_id.to_base58()).alive())
    return ServerSession(remote_model.swarm, Hop(server, 0, 1), max_length, batch_size, **kwargs).open()


def _still_serving(remote_model, local_model):
    ids = torch.tensor([[0, 9, 8, 7]])
    expected = local_model.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(remote_model.generate(ids, max_new_tokens=4, do_sample=False), expected)


def test_wrong_hidden_size(swarm, remote_model, local_model):
    session = _open(remote_model, swarm)
    try:
        with pytest.raises(BadRequestError, match="hidden_states"):
            session.step(torch.randn(1, 3, HIDDEN + 1), 0)
        with pytest.raises(BadRequestError, match="hidden_states"):
            session.step(torch.randn(1, 3, HIDDEN, dtype=torch.float64).to(torch.int64), 0)
        # The session itself survives a bad request.
        assert session.step(torch.randn(1, 3, HIDDEN), 0).shape == (1, 3, HIDDEN)
    finally:
        session.close()
    with remote_model.inference_session(max_length=8) as s, pytest.raises(BadRequestError):
        s.step(torch.randn(1, 2, HIDDEN + 1))  # checked before sending
    _still_serving(remote_model, local_model)


def test_oversized_tensor(swarm, remote_model, local_model):
    session = _open(remote_model, swarm, max_length=16)
    try:
        # 6000 positions x 64 floats: far more than a session of 16 positions may send. The
        # server reads and drops the message's frames (a bounded number), refuses it, and
        # the session goes on: the outcome is exact, not "refused or lost".
        with pytest.raises(BadRequestError, match="exceeds the limit"):
            session.step(torch.randn(1, 6000, HIDDEN), 0)
        assert session.step(torch.randn(1, 3, HIDDEN), 0).shape == (1, 3, HIDDEN)
    finally:
        session.close()
    _still_serving(remote_model, local_model)


def test_max_length(swarm, remote_model, local_model, monkeypatch):
    with remote_model.inference_session(max_length=8) as s:
        s.step(torch.randn(1, 6, HIDDEN))

        def no_network(*args):
            raise AssertionError("the step reached the servers")

        with monkeypatch.context() as patch:
            patch.setattr(s, "_run", no_network)  # refused before any compute or network
            with pytest.raises(MaxLengthError, match="max_length"):
                s.step(torch.randn(1, 3, HIDDEN))
        assert s.position == 6
        s.step(torch.randn(1, 2, HIDDEN))  # what fits still runs
    with remote_model.inference_session(max_length=10) as s, pytest.raises(MaxLengthError):
        remote_model.generate(torch.tensor([[0, 5, 6, 7]]), session=s, max_new_tokens=20)
    # The server checks too.
    session = _open(remote_model, swarm, max_length=4)
    try:
        with pytest.raises(MaxLengthError, match="max_length"):
            session.step(torch.randn(1, 5, HIDDEN), 0)
    finally:
        session.close()
    with pytest.raises(MaxLengthError, match="limit"):
        _open(remote_model, swarm, max_length=SERVER_MAX_LENGTH + 1)
    _still_serving(remote_model, local_model)


def test_cache_budget(swarm, remote_model, local_model):
    # 8 rows x 1024 positions x 256 bytes per position and block: about twice the budget.
    with pytest.raises(AllocationError, match="bytes"):
        _open(remote_model, swarm, max_length=SERVER_MAX_LENGTH, batch_size=8)
    with remote_model.inference_session(max_length=SERVER_MAX_LENGTH, batch_size=8) as s:
        with pytest.raises(AllocationError, match="no server"):
            s.step(torch.randn(8, 2, HIDDEN))
    _still_serving(remote_model, local_model)


def _free_bytes(remote_model, peer) -> int:
    return remote_model.swarm.info(peer)["free_bytes"]


def test_idle_timeout(swarm, remote_model, local_model):
    session = _open(remote_model, swarm, max_length=64, idle_timeout=1.0)
    peer = session.peer
    try:
        session.step(torch.randn(1, 3, HIDDEN), 0)
        assert _free_bytes(remote_model, peer) < CACHE_BYTES
        # Idle past its timeout, the session is closed by the server, its memory released.
        wait_until(lambda: _free_bytes(remote_model, peer) == CACHE_BYTES, "the server to drop the idle session")
        with pytest.raises(SessionTimeoutError, match="timeout"):
            session.step(torch.randn(1, 1, HIDDEN), 3)
    finally:
        session.close()
    assert _free_bytes(remote_model, peer) == CACHE_BYTES  # nothing taken again by the refused step
    _still_serving(remote_model, local_model)


@torch.inference_mode()
def test_timed_out_session_is_replayed(swarm, remote_model):
    """An InferenceSession whose servers dropped it replays its history and goes on, unchanged."""
    x = torch.randn(2, 5, HIDDEN)
    y = torch.randn(2, 1, HIDDEN)
    with remote_model.inference_session(max_length=16) as s:
        s.step(x)
        expected = s.step(y, hypo_ids=torch.tensor([1, 0]), start_position=4)
    with remote_model.inference_session(max_length=16, idle_timeout=0.5) as s:
        s.step(x)
        # The servers drop it once idle past its timeout: every live one then has all its memory free.
        live = [i.peer_id for i in remote_model.swarm.servers() if swarm.by_peer(i.peer_id.to_base58()).alive()]
        wait_until(lambda: all(_free_bytes(remote_model, peer) == CACHE_BYTES for peer in live),
                   "the servers to drop the idle session")
        out = s.step(y, hypo_ids=torch.tensor([1, 0]), start_position=4)
    assert torch.allclose(out, expected, atol=1e-5)
