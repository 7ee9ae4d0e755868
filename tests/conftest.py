import pytest
import torch
from support.models import build_llama, build_tokenizer

from continuous import models


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer(1000)


@pytest.fixture(scope="session")
def hf_model(tokenizer):
    return build_llama(tokenizer, "tiny", seed=0, max_position_embeddings=512)


@pytest.fixture(scope="session")
def model(hf_model, tokenizer):
    return models.transformers(hf_model, tokenizer)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


def pytest_collection_modifyitems(items):
    # A benchmark's smoke run is slow too: `-m "not slow"` leaves it out with the rest.
    for item in items:
        if item.get_closest_marker("bench"):
            item.add_marker(pytest.mark.slow)
