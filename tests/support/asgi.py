"""The server's application in this process, driven by the official ``openai`` client.

No port and no subprocess: requests go through ``httpx``'s ASGI transport (async) or
Starlette's test client (sync), so a test of the server's answers runs in seconds.
"""

from __future__ import annotations

try:  # the httpx the openai client uses: httpx2 where it is installed
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx
import openai
from starlette.testclient import TestClient

#: Where the clients believe the server is.
BASE = "http://in-process"


def async_client(app) -> openai.AsyncOpenAI:
    """An ``openai.AsyncOpenAI`` client of ``app`` (no retries)."""
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=BASE)
    return openai.AsyncOpenAI(base_url=BASE + "/v1", api_key="none", max_retries=0, http_client=http)


def sync_client(app) -> openai.OpenAI:
    """An ``openai.OpenAI`` client of ``app`` (no retries)."""
    return openai.OpenAI(base_url=BASE + "/v1", api_key="none", max_retries=0,
                         http_client=TestClient(app, base_url=BASE))
