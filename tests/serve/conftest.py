"""Servers for the tests, each stopped by its pid in its fixture's finalizer.

The model is the tiny test model (random weights, a BPE tokenizer) saved with a small
chat template, with a context of :data:`CONTEXT` tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.serving import Server, save_chat_model, start, stop

CONTEXT = 512


@pytest.fixture(scope="session")
def chat_model_dir(tmp_path_factory) -> Path:
    return save_chat_model(tmp_path_factory.mktemp("serve-model") / "tiny", "tiny", CONTEXT)


def _serving(request, tmp_path_factory, model_dir: Path, *args: str) -> Server:
    server = start(model_dir, tmp_path_factory.mktemp("serve-log") / "server.log", "--dtype", "float32", *args)
    request.addfinalizer(lambda: stop(server.pid))
    return server


@pytest.fixture(scope="module")
def server(request, tmp_path_factory, chat_model_dir) -> Server:
    """A server with room for 32 requests."""
    return _serving(request, tmp_path_factory, chat_model_dir, "--max-queue", "32")


@pytest.fixture(scope="module")
def small_server(request, tmp_path_factory, chat_model_dir) -> Server:
    """A server that takes one request at a time (a second gets 429)."""
    return _serving(request, tmp_path_factory, chat_model_dir, "--max-queue", "1")


@pytest.fixture(scope="module")
def local(chat_model_dir):
    """The same model in this process: the reference the server's answers must equal."""
    from continuous import models

    return models.transformers(str(chat_model_dir), dtype="float32")


@pytest.fixture(scope="session")
def chat_model(chat_model_dir):
    """The served model in this process, for apps tested without a subprocess (with a prefix
    cache, as the server's command line gives it)."""
    from continuous import models

    return models.transformers(str(chat_model_dir), dtype="float32", prefix_cache="64MB")
