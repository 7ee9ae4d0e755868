"""An OpenAI-compatible server: ``python -m continuous.serve MODEL --port 8000``.

It serves ``/v1/chat/completions`` and ``/v1/completions`` (streamed or whole, with ``n``,
``stop``, ``seed``, log-probabilities and JSON response formats), ``/v1/responses``
(OpenAI's Responses API, stateless), ``/v1/models`` and ``/health``. Needs the ``serve``
extra (``pip install continuous[serve]``).
:func:`build_app` gives the ASGI application, to serve a model loaded another way.
"""

__all__ = ["build_app"]


def __getattr__(name):
    # Loaded on use, so that ``python -m continuous.serve --help`` imports neither torch nor FastAPI.
    if name == "build_app":
        from .app import build_app

        return build_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
