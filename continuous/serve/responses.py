"""``POST /v1/responses``: OpenAI's Responses API, stateless, on the chat endpoint's path.

A request becomes the chat request it means (its ``instructions`` a system message, its
input items messages, an earlier ``function_call`` an assistant's ``tool_calls`` and a
``function_call_output`` a ``tool`` message), so that both endpoints render the same
prompt and make the same call; only the answer's shape differs. The output items
(``reasoning``, ``message``, ``function_call``) are built by one :class:`_Output`, from a
finished row or from a stream's deltas, so that a streamed response ends as the whole one.

Nothing is stored: ``previous_response_id`` is refused, and an agent loop sends back the
earlier output items as input, as it does with the chat endpoint's messages.
"""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from contextlib import aclosing
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from pydantic import ValidationError

from ..layout import encode
from .calls import Call, Delta, RequestError, Served
from .responses_wire import (
    INPUT_ITEMS,
    FunctionCall,
    FunctionCallItem,
    FunctionCallOutputItem,
    IncompleteDetails,
    InputMessage,
    InputTokensDetails,
    OutputMessage,
    OutputText,
    OutputTokensDetails,
    Reasoning,
    ReasoningText,
    Response,
    ResponseError,
    ResponsesRequest,
    ResponseUsage,
    StreamEvent,
)
from .wire import ChatRequest, TokenLogprob, TopLogprob, param_code

__all__ = ["register"]

log = logging.getLogger("continuous.serve")

#: Where a chat request's field comes from in a Responses request (for errors' ``param``).
_PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text.format"}

#: A finish reason that leaves a response incomplete, and why in the Responses API's words.
_INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}


def register(app: FastAPI, served: Served, *, answer: Callable) -> None:
    """Add ``POST /v1/responses`` (and ``GET /v1/responses/{id}``, which says nothing is kept) to ``app``.

    Parameters
    ----------
    app, served
        The application and its model.
    answer
        How the application answers a call (``answer(served, request, call, stream, shape)``: in a
        queue slot, whole or as events, by the shape's ``whole`` or ``events``).
    """

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request):
        served.check_model(body.model)
        if body.previous_response_id is not None:
            raise RequestError("this server is stateless and keeps no responses: send the whole conversation "
                               "in input (the earlier input items, then the previous response's output items)",
                               param="previous_response_id", code="unsupported_parameter")
        call = _call(served, body)
        return await answer(served, request, call, body.stream, _ResponseShape(served, body))

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str):
        raise RequestError(f"no response {response_id!r}: this server is stateless and keeps no responses",
                           status=404, param="response_id", code="not_found", kind="not_found_error")


def _call(served: Served, body: ResponsesRequest) -> Call:
    """The request's call: the chat request it means, prompted and checked as the chat endpoint does
    (a refusal names the Responses field at fault, not the chat one)."""
    chat = chat_request(body)
    try:
        return served.chat_call(chat, body.logprobs)
    except RequestError as exc:
        exc.param = _param(exc.param)
        raise


def _param(chat_param: str | None) -> str | None:
    """The Responses field that a chat request's field came from (``response_format`` is ``text.format``)."""
    if chat_param is None:
        return None
    first = chat_param.partition(".")[0]
    return _PARAMS[first] if first in _PARAMS else chat_param


def chat_request(body: ResponsesRequest) -> ChatRequest:
    """The chat request a Responses request means (same messages, tools and options).

    Raises
    ------
    RequestError
        For an input item or option the chat endpoint would refuse, naming the Responses field.
    """
    fields: dict[str, Any] = dict(
        model=body.model, messages=messages(body.instructions, body.input),
        max_completion_tokens=body.max_output_tokens, temperature=body.temperature, top_p=body.top_p,
        seed=body.seed, parallel_tool_calls=body.parallel_tool_calls)
    if body.format is not None:
        kind = body.format.type
        fields["response_format"] = {"type": kind} if kind != "json_schema" else {
            "type": kind, "json_schema": body.format.model_dump(by_alias=True, exclude={"type"}, exclude_none=True)}
    if body.tools:
        fields["tools"] = [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                           for tool in body.tools]
        fields["tool_choice"] = _tool_choice(body)
    elif body.tool_choice not in (None, "auto", "none"):
        raise RequestError(f"tool_choice {body.tool_choice!r} needs tools", param="tool_choice", code="invalid_value")
    try:
        return ChatRequest(**fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        param, code = param_code(first)
        param = _param(param)
        raise RequestError(f"{param or 'body'}: {first['msg']}", param=param, code=code) from exc


def _tool_choice(body: ResponsesRequest):
    """``tool_choice`` in chat's form (a named function is one of the tools)."""
    choice = body.tool_choice
    if choice is None or isinstance(choice, str):
        return choice
    names = [tool.name for tool in body.tools]
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        if choice["name"] not in names:
            raise RequestError(f"tool_choice names {choice['name']!r}, which is not among the tools {names}",
                               param="tool_choice.name", code="invalid_value")
        return {"type": "function", "function": {"name": choice["name"]}}
    raise RequestError("tool_choice is 'none', 'auto', 'required' or {'type': 'function', 'name': ...}; "
                       f"got {choice!r}", param="tool_choice", code="invalid_value")


def messages(instructions: str | None, input: str | list[dict]) -> list[dict]:
    """The chat messages of a Responses input: ``instructions`` first as a system message, then each
    item (consecutive calls join the assistant's turn before them; reasoning items are left out).

    Raises
    ------
    RequestError
        For an item that is not a text message, a call or a call's output, naming it (``input.3.type``).
    """
    out = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(input, str):
        return out + [{"role": "user", "content": input}]
    for i, raw in enumerate(input):
        item = _item(i, raw)
        if isinstance(item, InputMessage):
            out.append({"role": item.role, "content": item.text})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if out and out[-1]["role"] == "assistant":  # the calls of the turn whose text came before
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text})
    return out


def _item(i: int, raw: dict):
    """Input item ``i``, checked against its type's model."""
    kind = raw.get("type", "message")
    model = INPUT_ITEMS.get(kind)
    if model is None:
        hint = " (it needs stored items; this server keeps none)" if kind == "item_reference" else ""
        raise RequestError(f"input items of type {kind!r} are not supported{hint}: this server reads messages "
                           "with text parts, function_call and function_call_output items (reasoning items are "
                           "skipped)", param=f"input.{i}.type", code="unsupported_value")
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(["input", str(i), *map(str, first["loc"])])
        raise RequestError(f"{param}: {first['msg']}", param=param, code="invalid_value") from exc


class _Output:
    """A response's output items, built from a row's pieces as they come: its thinking, its text and
    its calls, each item opened when its first piece comes and closed when another kind's does.

    Each method returns the stream events that say what changed, as ``(type, fields)``. With
    ``logprobs``, the tokens' log-probabilities go with the text that follows them.
    """

    def __init__(self, logprobs: bool = False):
        self.items: list = []
        self.open = None  # the item being written
        self.calls: dict[int, FunctionCall] = {}  # by the call's index in the row
        self.logprobs = logprobs
        self.pending: list[TokenLogprob] = []  # log-probabilities not yet given with text

    def add(self, delta: Delta) -> list[tuple[str, dict]]:
        if self.logprobs:
            self.pending += _logprobs(delta.logprobs)
        events = self._reasoning(delta.reasoning) if delta.reasoning else []
        if delta.text:
            events += self._text(delta.text)
        for position, entry in enumerate(delta.tool_calls or ()):
            events += self._call(entry.get("index", position), entry)
        return events

    def close(self, status: str) -> list[tuple[str, dict]]:
        """Close the last item with ``status``; a complete answer without text or calls has an empty message."""
        events = []
        if status == "completed" and not any(isinstance(item, (OutputMessage, FunctionCall)) for item in self.items):
            events += self._opened(OutputMessage(id=_id("msg")))
        return events + self._closed(status)

    def _reasoning(self, text: str) -> list:
        events = [] if isinstance(self.open, Reasoning) else self._opened(Reasoning(id=_id("rs")))
        self.open.content[0].text += text
        return events + [("response.reasoning_text.delta", dict(self._where(), content_index=0, delta=text))]

    def _text(self, text: str) -> list:
        events = [] if isinstance(self.open, OutputMessage) else self._opened(OutputMessage(id=_id("msg")))
        self.open.content[0].text += text
        return events + [("response.output_text.delta", dict(self._where(), content_index=0, delta=text,
                                                              logprobs=self._given()))]

    def _given(self) -> list[dict]:
        """The pending log-probabilities, now part of the open message's text."""
        given, self.pending = self.pending, []
        if self.logprobs:
            self.open.content[0].logprobs += given
        return [_dump(entry) for entry in given]

    def _call(self, index: int, entry: dict) -> list:
        function = entry.get("function") or {}
        events = []
        if index not in self.calls:
            self.calls[index] = FunctionCall(id=_id("fc"), call_id=entry.get("id") or f"call_{uuid.uuid4().hex[:24]}",
                                             name=function.get("name") or "")
            events += self._opened(self.calls[index])
        elif self.open is not self.calls[index]:
            raise ValueError("a call's arguments came after another item began")
        if arguments := function.get("arguments"):
            self.open.arguments += arguments
            events.append(("response.function_call_arguments.delta", dict(self._where(), delta=arguments)))
        return events

    def _opened(self, item) -> list:
        """Close the open item and open ``item`` (with its one content part, for a message or thinking)."""
        events = self._closed("completed")
        part = OutputText(logprobs=[] if self.logprobs else None) if isinstance(item, OutputMessage) \
            else ReasoningText() if isinstance(item, Reasoning) else None
        self.items.append(item)
        self.open = item
        events.append(("response.output_item.added", dict(output_index=len(self.items) - 1, item=_dump(item))))
        if part is not None:
            item.content.append(part)
            events.append(("response.content_part.added", dict(self._where(), content_index=0, part=_dump(part))))
        return events

    def _closed(self, status: str) -> list:
        item, events = self.open, []
        if item is None:
            return events
        if isinstance(item, FunctionCall):
            events.append(("response.function_call_arguments.done", dict(self._where(), arguments=item.arguments)))
        else:
            part = item.content[0]
            if isinstance(part, OutputText):
                self._given()  # the last tokens' (their text was given before them)
                done = ("response.output_text.done", dict(text=part.text, logprobs=_dump(part).get("logprobs", [])))
            else:
                done = ("response.reasoning_text.done", dict(text=part.text))
            events += [(done[0], dict(self._where(), content_index=0, **done[1])),
                       ("response.content_part.done", dict(self._where(), content_index=0, part=_dump(part)))]
        item.status = status
        events.append(("response.output_item.done", dict(output_index=len(self.items) - 1, item=_dump(item))))
        self.open = None
        return events

    def _where(self) -> dict:
        return dict(output_index=len(self.items) - 1, item_id=self.open.id)


def _logprobs(entries: list[tuple]) -> list[TokenLogprob]:
    """The library's ``(text, logprob, [(alternative, logprob)])`` entries in OpenAI's form."""
    return [TokenLogprob(token=text, logprob=lp, bytes=list(text.encode()), top_logprobs=[
        TopLogprob(token=t, logprob=a, bytes=list(t.encode())) for t, a in alternatives])
        for text, lp, alternatives in entries]


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _dump(model) -> dict:
    return model.model_dump(exclude_none=True)


def _status(finish_reason: str | None) -> tuple[str, IncompleteDetails | None]:
    reason = _INCOMPLETE.get(finish_reason)
    return ("incomplete", IncompleteDetails(reason=reason)) if reason else ("completed", None)


class _ResponseShape:
    """The Responses API's shape of a call's answer: a response object, or its stream of events."""

    def __init__(self, served: Served, body: ResponsesRequest):
        self.served, self.body = served, body
        self.id = _id("resp")
        self.created = int(time.time())

    def whole(self, call: Call, state) -> Response:
        (row,) = call.rows(state)
        output = _Output(self.body.logprobs is not None)
        output.add(Delta(text=row.text, reasoning=row.reasoning or "", tool_calls=row.tool_calls,
                         logprobs=row.logprobs or []))
        status, details = _status(row.finish_reason)
        output.close(status)
        return self.response(status, output.items, details, self.usage(call, state, row))

    async def events(self, call: Call, stream) -> AsyncIterator[str]:
        """The response's server-sent events, from ``response.created`` to ``response.completed``
        (``response.incomplete`` when cut short, ``response.failed`` when the call fails)."""
        numbers = itertools.count()

        def event(kind: str, fields: dict) -> str:
            data = StreamEvent(type=kind, sequence_number=next(numbers), **fields).model_dump_json(exclude_none=True)
            return f"event: {kind}\ndata: {data}\n\n"

        output, finish = _Output(self.body.logprobs is not None), None
        for kind in ("response.created", "response.in_progress"):
            yield event(kind, dict(response=_dump(self.response("in_progress", []))))
        try:
            async with aclosing(call.deltas(stream)) as steps:
                async for (delta,) in steps:
                    finish = delta.finish_reason or finish
                    for kind, fields in output.add(delta):
                        yield event(kind, fields)
            status, details = _status(finish)
            for kind, fields in output.close(status):
                yield event(kind, fields)
            (row,) = call.rows(stream.state)  # for its token counts: the items are the stream's
            done = self.response(status, output.items, details, self.usage(call, stream.state, row))
            yield event(f"response.{status}", dict(response=_dump(done)))
        except Exception as exc:  # the status line is sent: the failure is the stream's last event
            log.exception("stream failed")
            failed = self.response("failed", output.items, error=ResponseError(
                code="server_error", message=f"{type(exc).__name__}: {exc}"))
            yield event("response.failed", dict(response=_dump(failed)))

    def usage(self, call: Call, state, row) -> ResponseUsage:
        prompt = call.prompt_tokens[0]
        thought = len(encode(self.served.model.tokenizer, row.reasoning, special=False)[0]) if row.reasoning else 0
        return ResponseUsage(input_tokens=prompt, input_tokens_details=InputTokensDetails(
                                 cached_tokens=state.tokens_cached),
                             output_tokens=row.tokens, output_tokens_details=OutputTokensDetails(
                                 reasoning_tokens=thought),
                             total_tokens=prompt + row.tokens)

    def response(self, status: str, items: list, details: IncompleteDetails | None = None,
                 usage: ResponseUsage | None = None, error: ResponseError | None = None) -> Response:
        body = self.body
        text = body.text.model_dump(by_alias=True, exclude_none=True) if body.text is not None else {}
        return Response(
            id=self.id, created_at=self.created, completed_at=int(time.time()) if status == "completed" else None,
            model=self.served.name, status=status, output=list(items), usage=usage, error=error,
            incomplete_details=details, instructions=body.instructions, max_output_tokens=body.max_output_tokens,
            temperature=body.temperature, top_p=body.top_p, top_logprobs=body.top_logprobs,
            tools=[tool.model_dump(exclude_none=True) for tool in body.tools or ()],
            tool_choice=body.tool_choice if body.tool_choice is not None else "auto",
            parallel_tool_calls=body.parallel_tool_calls is not False,
            text={"format": {"type": "text"}, **text},
            reasoning=body.reasoning.model_dump(exclude_none=True) if body.reasoning is not None else None,
            metadata=body.metadata)
