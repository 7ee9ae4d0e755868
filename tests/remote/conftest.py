"""Fixtures of the swarm tests: a swarm of server processes on a tiny model, on 127.0.0.1.

The servers are started once for the whole test session (see ``swarm_helpers``) and
each stopped by its id at the end.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.models import build_model_dir
from swarm_helpers import Swarm


@pytest.fixture(scope="session")
def swarm_model_dir(tmp_path_factory) -> Path:
    return build_model_dir(tmp_path_factory.mktemp("swarm") / "tiny", size="tiny")


@pytest.fixture(scope="session")
def swarm(swarm_model_dir, tmp_path_factory):
    """Servers for blocks 0:1 and 1:2 of the tiny model, and spares for 0:1.

    The failover tests each take one server of 0:1 down; starting their spares here, in
    parallel, is faster than starting replacements one by one.
    """
    swarm = Swarm(swarm_model_dir, tmp_path_factory.mktemp("swarm-logs"))
    try:
        swarm.start("0:1")
        swarm.start("1:2", "0:1", "0:1", "0:1")
        yield swarm
    finally:
        swarm.stop_all()


@pytest.fixture(scope="session")
def local_model(swarm_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(swarm_model_dir).eval()


@pytest.fixture(scope="session")
def remote_model(swarm, swarm_model_dir):
    from continuous.remote import DistributedModelForCausalLM

    model = DistributedModelForCausalLM.from_pretrained(swarm_model_dir, initial_peers=swarm.maddrs,
                                                        step_timeout=20.0)
    try:
        yield model
    finally:
        model.shutdown()


@pytest.fixture
def prompt() -> torch.Tensor:
    return torch.tensor([[0, 5, 17, 300, 42, 7, 81, 9]])
