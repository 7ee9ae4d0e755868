"""The agent frameworks' own clients against the server: each runs in an environment of
its own (``make test-clients``), since their pins of ``openai`` conflict.

This folder needs none of the library in its own environment: the model is saved and
served by the library's environment, named by ``CONTINUOUS_PYTHON``. Without it (in the
library's own runs) the folder is not collected.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))

from support.serving import NAME, Server, start, stop  # noqa: E402

PYTHON = os.environ.get("CONTINUOUS_PYTHON")
if PYTHON is None:
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> Server:
    """The tiny chat test model, saved and served by the library's environment."""
    folder = tmp_path_factory.mktemp("clients-model") / "tiny"
    subprocess.run([PYTHON, "-c", "import sys; from support.serving import save_chat_model; "
                    "save_chat_model(__import__('pathlib').Path(sys.argv[1]), context=2048)", str(folder)],
                   cwd=TESTS, check=True, timeout=300)
    running = start(folder, tmp_path_factory.mktemp("clients-log") / "server.log", "--dtype", "float32",
                    python=PYTHON)
    yield running
    stop(running.pid)


@pytest.fixture(scope="session")
def base_url(server) -> str:
    return server.url + "/v1"


@pytest.fixture(scope="session")
def name() -> str:
    return NAME
