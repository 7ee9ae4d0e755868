"""API keys: a request must carry ``Authorization: Bearer KEY`` (``/health`` stays open).

The key is compared in constant time, so that the time an answer takes says nothing of
how much of a guessed key was right. A refusal is OpenAI's 401 (``invalid_api_key``).
"""

from __future__ import annotations

import hmac

__all__ = ["BearerAuth", "OPEN_PATHS", "read_key"]

#: Paths answered without a key: load balancers and orchestrators probe them.
OPEN_PATHS = frozenset({"/health"})


def read_key(key: str | None = None, path: str | None = None) -> str | None:
    """The API key given as text or in a file (its surrounding whitespace dropped); ``None`` for none.

    Raises
    ------
    ValueError
        For both given, or an empty key.
    """
    if key is not None and path is not None:
        raise ValueError("give --api-key or --api-key-file, not both")
    if path is not None:
        with open(path, encoding="utf-8") as f:
            key = f.read()
    if key is None:
        return None
    key = key.strip()
    if not key:
        raise ValueError("the API key is empty")
    return key


class BearerAuth:
    """ASGI middleware answering 401 to every HTTP request but :data:`OPEN_PATHS` whose
    ``Authorization`` header is not ``Bearer KEY``."""

    def __init__(self, app, key: str):
        if not key:
            raise ValueError("the API key is empty")
        self.app, self.key = app, key.encode("utf-8")
        # Imported here: the command line reads its key (read_key) before FastAPI loads.
        from starlette.responses import JSONResponse

        from .wire import ErrorBody, ErrorResponse

        body = ErrorResponse(error=ErrorBody(
            message="a valid API key is needed: send it as 'Authorization: Bearer KEY'",
            type="invalid_request_error", code="invalid_api_key"))
        self.refusal = lambda: JSONResponse(body.model_dump(), status_code=401,
                                            headers={"WWW-Authenticate": "Bearer"})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self._holds_key(scope):
            await self.app(scope, receive, send)
            return
        await self.refusal()(scope, receive, send)

    def _holds_key(self, scope) -> bool:
        given = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = given.partition(b" ")
        # compare_digest takes as long whatever prefix of the key matches.
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)
