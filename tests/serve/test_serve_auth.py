"""API keys: requests without ``Authorization: Bearer KEY`` get OpenAI's 401; ``/health`` stays open."""

from __future__ import annotations

import openai
import pytest
from fastapi.testclient import TestClient
from support.serving import NAME, in_process

from continuous.serve import build_app
from continuous.serve.auth import BearerAuth, read_key

KEY = "sk-test-0123456789"


@pytest.fixture(scope="module")
def app(chat_model):
    return build_app(chat_model, name=NAME, api_key=KEY)


def test_the_right_key_is_served(app):
    with in_process(app, api_key=KEY) as client:
        answer = client.completions.create(model=NAME, prompt="User: hi", max_tokens=3, temperature=0)
        assert answer.choices[0].finish_reason in ("stop", "length")
        assert [m.id for m in client.models.list().data] == [NAME]


@pytest.mark.parametrize("key", ["wrong", KEY[:-1], KEY + "0", "none"])
def test_a_wrong_key_gets_401_in_openai_shape(app, key):
    with in_process(app, api_key=key) as client, pytest.raises(openai.AuthenticationError) as refused:
        client.completions.create(model=NAME, prompt="User: hi", max_tokens=3)
    assert refused.value.status_code == 401 and refused.value.code == "invalid_api_key"
    assert refused.value.body["type"] == "invalid_request_error" and refused.value.body["param"] is None


@pytest.mark.parametrize("headers", [{}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"},
                                     {"Authorization": "Bearer"}, {"X-Api-Key": KEY}])
def test_a_missing_or_malformed_header_gets_401_and_health_stays_open(app, headers):
    with TestClient(app) as http:
        for path in ("/v1/models", "/metrics", "/docs"):
            refused = http.get(path, headers=headers)
            assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
            assert refused.json()["error"]["code"] == "invalid_api_key"
        assert http.get("/health", headers=headers).json()["status"] == "ok"
        assert http.get("/v1/models", headers={"Authorization": f"bearer {KEY}"}).status_code == 200
        assert http.get("/metrics", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_an_app_without_a_key_asks_for_none(chat_model):
    with TestClient(build_app(chat_model, name=NAME)) as http:
        assert http.get("/v1/models").status_code == 200


def test_the_key_is_read_from_text_or_a_file(tmp_path):
    (tmp_path / "key").write_text(f"  {KEY}\n")
    assert read_key(KEY) == KEY and read_key(path=str(tmp_path / "key")) == KEY and read_key() is None
    (tmp_path / "empty").write_text("\n")
    for bad in ({"key": " "}, {"path": str(tmp_path / "empty")}, {"key": KEY, "path": str(tmp_path / "key")}):
        with pytest.raises(ValueError):
            read_key(**bad)
    with pytest.raises(ValueError):
        BearerAuth(None, "")
