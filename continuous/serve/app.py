"""The server's routes: OpenAI's chat and text completions, models, and health.

Every error is OpenAI-shaped (``{"error": {"message", "type", "param", "code"}}``).
A request counts against the queue from its arrival to its last byte; past the
queue's length the server answers 429. A client that goes away (mid-stream, or
while waiting for a whole answer) has its call closed, which frees its rows at the
next step.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from contextlib import aclosing
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from ..think import thinking
from . import responses
from .auth import BearerAuth
from .calls import Call, Delta, RequestError, Served
from .metrics import add_metrics_route
from .tokens import add_token_routes
from .wire import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatMessage,
    ChatRequest,
    ChoiceLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    ErrorBody,
    ErrorResponse,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    TokenLogprob,
    TopLogprob,
    Usage,
    param_code,
    place,
)

__all__ = ["build_app"]

log = logging.getLogger("continuous.serve")


def build_app(model, *, name: str, max_queue: int = 64, think: bool | int | None = None,
              api_key: str | None = None) -> FastAPI:
    """The OpenAI-compatible application serving ``model``.

    Parameters
    ----------
    model
        A continuous model (``models.transformers(...)``).
    name
        The model's name: requests must give it as ``model``.
    max_queue
        Most requests running or waiting at once; more are answered 429.
    think
        Every answer thinks first, within the markers of the model's chat template or
        tokenizer (``True``, or an int: a budget of tokens), as ``think=`` says; chat answers
        give the thinking in ``reasoning_content``.
    api_key
        Every request but ``/health`` must carry ``Authorization: Bearer API_KEY``; others
        are answered 401 (``None``: no key is asked).

    Raises
    ------
    ValueError
        With ``think``, for a model whose markers are unknown.
    """
    thinking(think, model.tokenizer)  # unknown markers fail now, not at every request
    served = Served(model, name, max_queue, think)

    # Calls in flight are stepped together by the model's engine (one loop for every call's
    # rows), so that they share the model's forward passes.
    app = FastAPI(title="continuous")
    app.state.served = served
    _errors(app)
    _routes(app, served)
    responses.register(app, served, answer=_answer)
    add_token_routes(app, served)
    add_metrics_route(app, served)
    if api_key is not None:
        app.add_middleware(BearerAuth, key=api_key)
    return app


def _error(status: int, message: str, param: str | None = None, code: str | None = None,
           kind: str = "invalid_request_error") -> JSONResponse:
    body = ErrorResponse(error=ErrorBody(message=message, type=kind, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status)


def _errors(app: FastAPI) -> None:
    @app.exception_handler(RequestError)
    async def refused(request, exc: RequestError):
        return _error(exc.status, exc.message, exc.param, exc.code, exc.kind)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc: RequestValidationError):
        first = exc.errors()[0]
        if first.get("type") == "json_invalid":
            return _error(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}",
                          code="invalid_json")
        param, code = param_code(first)
        problems = "; ".join(f"{place(e) or 'body'}: {e['msg']}" for e in exc.errors())
        return _error(400, problems, param, code)

    @app.exception_handler(HTTPException)
    async def http(request, exc: HTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request")
        return _error(exc.status_code, str(exc.detail), code=code, kind=kind)

    @app.exception_handler(Exception)
    async def failed(request, exc: Exception):
        log.exception("request failed")
        return _error(500, f"the server failed: {type(exc).__name__}: {exc}", kind="server_error")


#: pydantic's error types in OpenAI's codes (any other is ``invalid_value``).


def _routes(app: FastAPI, served: Served) -> None:
    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "model": served.name, "in_flight": served.in_flight,
                "max_queue": served.max_queue, "stats": served.stats()}

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        return ModelList(data=[ModelCard(id=served.name, created=served.created,
                                         max_model_len=served.model.max_length)])

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        served.check_model(body.model)
        call = served.chat_call(body, (body.top_logprobs or 0) if body.logprobs else None)
        return await _answer(served, request, call, body.stream, _ChatShape(served, body))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        served.check_model(body.model)
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        call = served.call(prompts, body, body.limit, body.logprobs, param="prompt")
        return await _answer(served, request, call, body.stream, _TextShape(served, body))


async def _answer(served: Served, request: Request, call: Call, stream: bool, shape: "_Shape"):
    """Run the call in a queue slot: the whole answer, or its server-sent events."""
    served.admit()
    try:
        started = call.astream()  # the call's arguments are checked here, before any answer
    except (ValueError, TypeError) as exc:
        served.release()
        raise RequestError(str(exc), param=_named(str(exc), shape.body)) from exc
    tracked = served.metrics.track(call, started)

    def done() -> None:
        try:
            served.metrics.done(tracked)
        finally:
            served.release()

    if stream:
        return _Events(shape.events(call, started), done)
    try:
        state = await _unless_gone(request, started.run())
    finally:
        done()
    if state is None:  # the client left: nobody reads an answer
        return JSONResponse({}, status_code=499)
    return JSONResponse(shape.whole(call, state).model_dump(exclude_none=True))


def _named(message: str, body: BaseModel) -> str | None:
    """The request's field that a library's refusal names first (its messages begin with the
    argument's name: ``logit_bias: 5000 is not a token id...``)."""
    return next((f for f in sorted(body.model_fields_set, key=len, reverse=True) if message.startswith(f)), None)


async def _unless_gone(request: Request, work) -> Any:
    """``work``'s result, or ``None`` when the client disconnects first (``work`` is then cancelled)."""
    task = asyncio.ensure_future(work)

    async def gone():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()  # the stream closes after the step under way, freeing its rows
            await asyncio.wait({task})
    return task.result() if not task.cancelled() else None


class _Events(StreamingResponse):
    """Server-sent events whose source is closed however the response ends, a client gone included."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            self._on_close()


def _sse(item: BaseModel) -> str:
    return f"data: {item.model_dump_json(exclude_none=True)}\n\n"


class _Shape:
    """How one endpoint writes a call's answer: whole, or as chunks."""

    prefix = "cmpl"

    def __init__(self, served: Served, body):
        self.served, self.body = served, body
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def usage(self, call: Call, state, rows) -> Usage:
        prompt = sum(call.prompt_tokens)
        completion = sum(row.tokens for row in rows)
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=state.tokens_cached))

    async def events(self, call: Call, stream) -> AsyncIterator[str]:
        """The answer as server-sent events, ending with ``[DONE]`` (an error event if the call fails)."""
        try:
            for opening in self.opening(call):
                yield _sse(opening)
            async with aclosing(call.deltas(stream)) as steps:
                async for step in steps:
                    if any(map(_says, step)):
                        yield _sse(self.chunk(step))
            options = self.body.stream_options
            if options is not None and options.include_usage:
                yield _sse(self.usage_chunk(self.usage(call, stream.state, call.rows(stream.state))))
        except Exception as exc:  # the status line is sent: the error goes in the stream
            log.exception("stream failed")
            yield _sse(ErrorResponse(error=ErrorBody(message=f"{type(exc).__name__}: {exc}", type="server_error")))
        yield "data: [DONE]\n\n"

    def opening(self, call: Call) -> list:
        return []


class _ChatShape(_Shape):
    prefix = "chatcmpl"

    def whole(self, call: Call, state) -> ChatCompletion:
        rows = call.rows(state)
        choices = [ChatChoice(index=i, message=ChatMessage(content=row.text if row.text or not row.tool_calls
                                                           else None, tool_calls=row.tool_calls,
                                                           reasoning_content=row.reasoning),
                              finish_reason=row.finish_reason,
                              logprobs=_chat_logprobs(row.logprobs, self.body.logprobs),
                              choice_scores=row.choice_scores)
                   for i, row in enumerate(rows)]
        return ChatCompletion(id=self.id, created=self.created, model=self.served.name, choices=choices,
                              usage=self.usage(call, state, rows))

    def opening(self, call: Call) -> list:
        rows = len(call.prompts) * call.n
        return [self._chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))
                             for i in range(rows)])]

    def chunk(self, step: list[Delta]) -> ChatCompletionChunk:
        return self._chunk([ChatChunkChoice(index=i, delta=_chat_delta(d), finish_reason=d.finish_reason,
                                            logprobs=_chat_logprobs(d.logprobs, self.body.logprobs),
                                            choice_scores=d.choice_scores)
                            for i, d in enumerate(step) if _says(d)])

    def usage_chunk(self, usage: Usage) -> ChatCompletionChunk:
        return self._chunk([], usage)

    def _chunk(self, choices, usage=None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.served.name, choices=choices,
                                   usage=usage)


class _TextShape(_Shape):
    def whole(self, call: Call, state) -> Completion:
        rows = call.rows(state)
        choices = [CompletionChoice(index=i, text=row.text, finish_reason=row.finish_reason,
                                    logprobs=_text_logprobs(row.logprobs), choice_scores=row.choice_scores)
                   for i, row in enumerate(rows)]
        return Completion(id=self.id, created=self.created, model=self.served.name, choices=choices,
                          usage=self.usage(call, state, rows))

    def chunk(self, step: list[Delta]) -> Completion:
        wanted = self.body.logprobs is not None
        return Completion(id=self.id, created=self.created, model=self.served.name, choices=[
            CompletionChoice(index=i, text=d.text, finish_reason=d.finish_reason,
                             logprobs=_text_logprobs(d.logprobs) if wanted else None, choice_scores=d.choice_scores)
            for i, d in enumerate(step) if _says(d)])

    def usage_chunk(self, usage: Usage) -> Completion:
        return Completion(id=self.id, created=self.created, model=self.served.name, choices=[], usage=usage)


def _says(d: Delta) -> bool:
    """Whether a row's delta has anything to send."""
    return bool(d.text or d.reasoning or d.tool_calls or d.logprobs or d.finish_reason)


def _chat_delta(d: Delta) -> ChatDelta:
    """A row's delta in chat's form: text, thinking, and calls (each with its ``index``)."""
    return ChatDelta(content=d.text or None, reasoning_content=d.reasoning or None, tool_calls=d.tool_calls)


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def _chat_logprobs(entries: list[tuple] | None, wanted: bool) -> ChoiceLogprobs | None:
    """The library's ``(text, logprob, [(alternative, logprob)])`` entries in chat's form."""
    if not wanted or entries is None:
        return None
    return ChoiceLogprobs(content=[
        TokenLogprob(token=text, logprob=lp, bytes=_bytes(text),
                     top_logprobs=[TopLogprob(token=t, logprob=a, bytes=_bytes(t)) for t, a in alternatives])
        for text, lp, alternatives in entries])


def _text_logprobs(entries: list[tuple] | None) -> CompletionLogprobs | None:
    """The entries in the legacy completions' form (``text_offset`` counts from the choice's start)."""
    if entries is None:
        return None
    out, offset = CompletionLogprobs(), 0
    for text, lp, alternatives in entries:
        out.tokens.append(text)
        out.token_logprobs.append(lp)
        out.top_logprobs.append(dict(alternatives))
        out.text_offset.append(offset)
        offset += len(text)
    return out
