"""A server fails or leaves mid-session: a spare takes its blocks over, and the output is unchanged."""

import logging
import time

import pytest
import torch
from transformers import StoppingCriteria

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]  # the first test also starts the swarm

logger = logging.getLogger(__name__)


class _AtLength(StoppingCriteria):
    """Calls ``action`` once, when the sequences reach ``length`` tokens; never stops generation."""

    def __init__(self, length, action):
        self.length, self.action, self.done = length, action, False

    def __call__(self, input_ids, scores, **kwargs):
        if not self.done and input_ids.shape[1] >= self.length:
            self.done = True
            self.action()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def _server_of_first_span(swarm, session):
    peer, start, end = session.servers[0]
    assert (start, end) == (0, 1)
    return swarm.by_peer(peer)


@pytest.mark.parametrize("num_beams", [1, 3])
def test_crash_mid_generate(swarm, remote_model, local_model, prompt, num_beams):
    """SIGKILL of the server of blocks 0:1 (and its daemon) between two decoding steps."""
    swarm.ensure("0:1", 2)
    killed = []
    with remote_model.inference_session(max_length=64, batch_size=num_beams) as session:
        crash = _AtLength(prompt.shape[1] + 4, lambda: killed.append(_server_of_first_span(swarm, session).kill()))
        out = remote_model.generate(prompt, session=session, max_new_tokens=10, num_beams=num_beams,
                                    do_sample=False, stopping_criteria=[crash])
        assert killed and session.servers[0][0] not in [s.peer_id for s in swarm.servers if not s.alive()]
    expected = local_model.generate(prompt, max_new_tokens=10, num_beams=num_beams, do_sample=False)
    assert torch.equal(out, expected)


@torch.inference_mode()
def test_leave_between_steps(swarm, remote_model, prompt):
    """SIGTERM: the server closes its sessions and leaves the DHT; rewinds and forks survive the replay."""
    swarm.ensure("0:1", 2)
    embed = remote_model.model.embed_tokens
    steps = [  # (tokens, hypo_ids, start_position)
        (prompt.expand(2, -1), None, None),
        (torch.tensor([[3], [4]]), None, None),
        (torch.tensor([[5], [6]]), torch.tensor([1, 1]), None),  # fork row 1
        (torch.tensor([[7], [8]]), torch.tensor([0, 1]), 6),  # rewind
        (torch.tensor([[9], [10]]), None, None),
    ]

    def run(leave_after=-1):
        outputs, times = [], []
        with remote_model.inference_session(max_length=32) as session:
            for i, (ids, hypo_ids, start) in enumerate(steps):
                t0 = time.perf_counter()
                outputs.append(session.step(embed(ids), hypo_ids, start_position=start))
                times.append(time.perf_counter() - t0)
                if i == leave_after:
                    left = _server_of_first_span(swarm, session)
                    assert left.stop() == 0  # exits cleanly
                    assert session.servers[0][0] == left.peer_id
            if leave_after >= 0:
                assert session.servers[0][0] != left.peer_id
        return outputs, times

    expected, _ = run()
    outputs, times = run(leave_after=2)
    logger.info("failover after a server left: the next step took %.2f s", times[3])
    for out, exp in zip(outputs, expected):
        assert torch.allclose(out, exp, atol=1e-5)
