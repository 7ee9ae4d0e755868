"""From a request to a library call, and from its state to what each choice says.

The HTTP side (routes, server-sent events, errors' status codes) is in :mod:`.app`;
here is what a request asks of the model: its prompts and their token counts (checked
against the context before any compute), the generator for its response format and
``n``, the call's options, and, from the final state, each row's text, finish reason,
log-probabilities and token count.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field, fields
from typing import Any, AsyncIterator

import anyio

from .. import chat, generate, samplers
from ..engines.tools import Written
from ..generate.tools import _described
from ..layout import encode
from ..wrapper import ContinuousGenerator, continuous
from .metrics import Metrics
from .wire import Constraint, ResponseFormat

__all__ = ["RequestError", "Served", "Call", "Row", "Delta", "FINISH"]

#: The library's finish reasons in OpenAI's words (a reply that calls tools says
#: ``tool_calls`` instead).
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length",
          "ban_exhausted": "content_filter"}

#: Generators kept for reuse, by response format and ``n`` (a JSON schema compiles once).
GENERATORS_KEPT = 64


class RequestError(Exception):
    """A request the server refuses: an OpenAI-shaped error with an HTTP status, the field it is
    about (``param``) and what kind of refusal it is (``code``)."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None, code: str = "invalid_value",
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.status, self.param, self.code, self.kind = message, status, param, code, kind


@dataclass
class Row:
    """What one row (one choice) of a finished call says: its answer's text, and the calls
    and thinking it holds apart from it."""

    text: str
    finish_reason: str
    tokens: int
    logprobs: list[tuple] | None
    tool_calls: list[dict] | None = None
    reasoning: str | None = None
    choice_scores: dict[str, float] | None = None  # each option's log-probability, for a choice


@dataclass
class Delta:
    """What one row adds to a stream at one step; ``finish_reason`` is set on its last delta."""

    text: str = ""
    logprobs: list[tuple] = field(default_factory=list)
    finish_reason: str | None = None
    reasoning: str = ""
    tool_calls: list[dict] | None = None
    choice_scores: dict[str, float] | None = None  # on a choice's last delta


@dataclass
class Call:
    """A request made ready: the generator, its prompts and the call's options."""

    generator: ContinuousGenerator
    prompts: list[str]
    prompt_tokens: list[int]
    n: int
    stops: list[str]
    options: dict[str, Any]

    def astream(self):
        """The call's async stream (its arguments are checked now). A client that leaves drops
        its stream: no step keeps a snapshot of what the client has seen."""
        prompt = self.prompts[0] if len(self.prompts) == 1 else self.prompts
        return self.generator.astream(prompt, **self.options)._no_snapshots()

    @property
    def tools(self):
        """The :class:`~continuous.generate.tools.ToolsGenerator` of a reply that may call tools, else ``None``."""
        made = self.generator.generator
        return made if made.kind == "tools" else None

    @property
    def think(self):
        return self.generator.generator.think

    def rows(self, state) -> list[Row]:
        """Each row's text (without the stop string it ended on), reason, token count and log-probabilities;
        its calls and its thinking, apart."""
        counts = state.attention_mask.sum(1).tolist()
        reasons = state.finish_reasons
        logprobs, scores = state.logprobs, state.choice_scores
        out = []
        for r, full in enumerate(state):
            prompt = self.prompts[r // self.n]
            text = full[len(prompt):]
            if reasons[r] == "stop":
                text = _without_stop(text, self.stops)
            row = Row(text, FINISH.get(reasons[r], "stop"), counts[r] - self.prompt_tokens[r // self.n],
                      logprobs[r] if logprobs is not None else None)
            if self.think is not None:  # the library wrote the opening marker after the prompt
                row.reasoning, row.text = self.generator.generator.parse.parts(text.removeprefix(self.think.open))
            if self.tools:  # each row read alone: one cut short leaves the others' calls whole
                _calls(row, self.tools.read(row.text))
            row.choice_scores = scores[r] if scores is not None else None
            out.append(row)
        return out

    async def deltas(self, stream) -> AsyncIterator[list[Delta]]:
        """Per step, each row's new text; a stop string, and text that may begin one, are held back.

        A reply that may call tools sends its text outside calls, and each call as OpenAI streams
        them: its id and name first, then its arguments as they are written. The last item gives
        each row the rest of its final text and calls, and its finish reason.
        """
        rows = len(self.prompts) * self.n
        raw, sent, logged = [""] * rows, [0] * rows, [0] * rows
        calls = [_StreamedCalls() for _ in range(rows)]
        want_logprobs = self.options.get("logprobs") is not None
        try:
            async for pieces in stream:
                entries = stream.state.logprobs if want_logprobs else None
                step = []
                for r, piece in enumerate(_flat(pieces, rows)):
                    thought = piece.reasoning if self.think is not None else ""
                    raw[r] += piece.answer if self.think is not None else piece
                    shown, made = raw[r][:_safe(raw[r], self.stops)], None
                    if self.tools:  # the text outside calls, as far as it cannot turn into one
                        written = self.tools.read(shown, final=False)
                        shown, made = written.text.strip(), calls[r].step(written)
                    delta = Delta(shown[sent[r]:], entries[r][logged[r]:] if entries else [], None, thought, made)
                    sent[r], logged[r] = max(sent[r], len(shown)), logged[r] + len(delta.logprobs)
                    step.append(delta)
                yield step
        finally:  # however the stream ends (a client gone too), its rows leave the model's steps
            with anyio.CancelScope(shield=True):  # before its queue slot does, a client gone too
                await stream.aclose()
        final = self.rows(stream.state)
        yield [Delta(row.text[sent[r]:], (row.logprobs or [])[logged[r]:], row.finish_reason,
                     tool_calls=calls[r].rest(row.tool_calls), choice_scores=row.choice_scores) for r, row in enumerate(final)]


class _StreamedCalls:
    """What a row's stream has sent of its calls: each call's id, and how much of its arguments."""

    def __init__(self):
        self.ids: list[str] = []
        self.sent: list[int] = []

    def step(self, written: Written) -> list[dict] | None:
        """The calls' deltas since the last step: a call's id and name once its name is written
        (its arguments then follow, from the next step on), then its new arguments."""
        out = []
        for i, call in enumerate(written.calls):
            if call.name is None:
                break
            if i == len(self.ids):
                self.ids.append(_call_id())
                self.sent.append(0)
                out.append({"index": i, "id": self.ids[i], "type": "function",
                            "function": {"name": call.name, "arguments": ""}})
            elif len(call.arguments) > self.sent[i]:
                out.append({"index": i, "function": {"arguments": call.arguments[self.sent[i]:]}})
                self.sent[i] = len(call.arguments)
        return out or None

    def rest(self, final: list[dict] | None) -> list[dict] | None:
        """The deltas that complete the final calls: the rest of the arguments of those sent, the
        calls not yet sent whole."""
        out = []
        for i, call in enumerate(final or []):
            if i >= len(self.ids):
                out.append({"index": i, **call})
                continue
            call["id"] = self.ids[i]
            if len(call["function"]["arguments"]) > self.sent[i]:
                out.append({"index": i, "function": {"arguments": call["function"]["arguments"][self.sent[i]:]}})
        return out or None


def _flat(pieces, rows: int) -> list[str]:
    """A stream's piece (shaped like ``value``) as one string per row."""
    if rows == 1:
        return [pieces]
    if pieces and isinstance(pieces[0], list):
        return [p for group in pieces for p in group]
    return list(pieces)


def _safe(text: str, stops: list[str]) -> int:
    """How much of ``text`` may be streamed: up to a stop string in it, or to what could begin one."""
    found = [at for at in (text.find(s) for s in stops) if at >= 0]
    if found:
        return min(found)
    for k in range(min(len(text), max(map(len, stops), default=1) - 1), 0, -1):
        if any(s.startswith(text[-k:]) for s in stops):
            return len(text) - k
    return len(text)


def _calls(row: Row, written: Written) -> None:
    """A reply's calls in OpenAI's form (the arguments as the model wrote them), its text beside
    them. A call cut short (by ``max_tokens``) comes with the arguments written so far and the
    row's own finish reason, as OpenAI's do; a reply whose calls are whole says ``tool_calls``."""
    row.text = written.text.strip()
    named = [c for c in written.calls if c.name is not None]
    if named:
        row.tool_calls = [{"id": _call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                          for c in named]
        if all(c.done for c in written.calls):
            row.finish_reason = "tool_calls"


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _tool_choice(choice, names: list[str]) -> str:
    """A request's ``tool_choice`` as the library takes it: ``"auto"``, ``"required"``, ``"none"`` or
    the name of one of the tools, from a string, ``{"type": "function", "function": {"name": ...}}``
    or the flat ``{"type": "function", "name": ...}``; what names no tool of the request is refused."""
    if choice is None:
        return "auto"
    if isinstance(choice, dict):
        inner = choice.get("function", choice)
        name = inner.get("name") if isinstance(inner, dict) and choice.get("type") == "function" else None
        if not isinstance(name, str):
            raise RequestError(f"tool_choice {choice!r} names no tool: give \"auto\", \"required\", \"none\" or "
                               '{"type": "function", "function": {"name": ...}}', param="tool_choice",
                               code="invalid_value")
        choice = name
    if choice not in ("auto", "required", "none", *names):
        raise RequestError(f"tool_choice names {choice!r}, which is not one of the tools {names}",
                           param="tool_choice", code="invalid_value")
    return choice


def _without_stop(text: str, stops: list[str]) -> str:
    """``text`` less the stop string it ends with (the longest, which began first)."""
    ending = [s for s in stops if text.endswith(s)]
    return text[: len(text) - max(map(len, ending))] if ending else text


class Served:
    """The served model: its name, its generators, and the requests in flight.

    Parameters
    ----------
    model
        A continuous model (``models.transformers(...)``).
    name
        The model's name in requests and in ``/v1/models``.
    max_queue
        Most requests running or waiting at once; more are refused (429).
    """

    def __init__(self, model, name: str, max_queue: int, think: bool | int | None = None):
        self.model, self.name, self.max_queue = model, name, max_queue
        self.think = think  # every generator's think=: its answers think first
        self.created = int(time.time())
        self.in_flight = 0
        self.metrics = Metrics(self)
        self._generators: OrderedDict[tuple, ContinuousGenerator] = OrderedDict()

    def check_model(self, name: str | None) -> None:
        """Refuse (404) a request naming another model (``None``: llama.cpp's clients name none)."""
        if name is not None and name != self.name:
            raise RequestError(f"the model {name!r} is not served here; this server serves {self.name!r}",
                               status=404, param="model", code="model_not_found", kind="not_found_error")

    def admit(self) -> None:
        """Count one more request in flight, or refuse it when the queue is full."""
        if self.in_flight >= self.max_queue:
            self.metrics.rejected.inc()
            raise RequestError(f"the server is busy: {self.in_flight} requests are running or waiting "
                               f"(at most {self.max_queue}); retry later", status=429,
                               code="rate_limit_exceeded", kind="rate_limit_error")
        self.in_flight += 1

    def release(self) -> None:
        self.in_flight -= 1

    def stats(self) -> dict[str, int]:
        """The model's counters (forward passes, tokens forwarded...)."""
        stats = self.model.stats
        return {f.name: getattr(stats, f.name) for f in fields(stats) if not f.name.startswith("_")}

    def chat_prompt(self, messages: list[dict], generator: ContinuousGenerator | None = None) -> str:
        """The messages in the model's chat template, ending with the assistant's opening (with
        the tools, for a tools ``generator``)."""
        from jinja2 import TemplateError

        if getattr(self.model.tokenizer, "chat_template", None) is None:
            raise RequestError("this model has no chat template: use /v1/completions, or start the server "
                               "with --chat-template FILE", param="messages")
        try:
            if generator is not None and generator.generator.kind == "tools":
                return generator.generator.prompt(messages)
            return chat.prompt(self.model, messages)
        except TemplateError as exc:  # the template's own checks (roles that must alternate...)
            raise RequestError(f"the chat template refused the messages: {exc}", param="messages") from exc

    def chat_call(self, request, logprobs: int | None) -> Call:
        """A chat request's call: its messages in the chat template, with its tools' generator
        when it gives tools (its calls then come back apart from its text)."""
        generator = None
        if request.tools:
            generator = self.tools_generator(request.tools, request.tool_choice, request.n,
                                             request.parallel_tool_calls is not False)
        elif request.tool_choice is not None:
            raise RequestError("tool_choice needs tools", param="tool_choice", code="invalid_value")
        prompt = self.chat_prompt([m.template_dict() for m in request.messages], generator)
        return self.call([prompt], request, request.limit, logprobs, param="messages", generator=generator)

    def call(self, prompts: list[str], request, limit: int | None, logprobs: int | None, param: str,
             generator: ContinuousGenerator | None = None) -> Call:
        """A request's call, checked: prompts within the context, a valid format, sound options."""
        counts = [self._count(p, limit, param) for p in prompts]
        sampling = {"temperature": request.temperature, "top_p": request.top_p}
        if request.temperature == 0:
            sampling = {"temperature": 0}  # greedy, whatever top_p says
        options = dict(max_tokens=limit, stop_at=request.stops or None, seed=request.seed, logprobs=logprobs,
                       **{k: v for k, v in sampling.items() if v is not None})
        # Read by name: a request type without these controls (another endpoint's) has none.
        bias = getattr(request, "logit_bias", None)
        if bias:
            options["logit_bias"] = {int(token): value for token, value in bias.items()}
        options.update({k: v for k in ("presence_penalty", "frequency_penalty") if (v := getattr(request, k, 0))})
        generator = generator or self.generator(request.response_format, request.n,
                                                getattr(request, "constraint", None))
        return Call(generator, prompts, counts, request.n, request.stops, options)

    def encode(self, prompt: str, special: bool = True) -> list[int]:
        """The prompt's token ids, as a call encodes it (``special``: with the tokenizer's BOS)."""
        return encode(self.model.tokenizer, prompt, special=special)[0]

    def _count(self, prompt: str, limit: int | None, param: str) -> int:
        """The prompt's tokens (as the call will encode it), refused when the context cannot hold the call."""
        count = len(self.encode(prompt))
        context = self.model.max_length
        if count >= context or (limit is not None and count + limit > context):
            wanted = f"{count} in the prompt" + (f" and {limit} to generate" if limit is not None else "")
            raise RequestError(f"this model's context is {context} tokens; the request needs {wanted}. "
                               "Shorten the prompt or lower max_tokens", param=param,
                               code="context_length_exceeded")
        return count

    def generator(self, response_format: ResponseFormat | None, n: int, constraint: Constraint | None = None
                  ) -> ContinuousGenerator:
        """The generator for a response format, or a constraint, with ``n`` samples per prompt,
        built once and kept."""
        if constraint is not None:
            return self._constrained(constraint, n)
        kind = response_format.type if response_format is not None else "text"
        schema = {"type": "object"} if kind == "json_object" else None
        if kind == "json_schema":
            schema = response_format.json_schema.schema_
        if schema is None:
            return self._kept(("text", n), lambda sampler: generate.text(self.model, sampler, think=self.think))
        return self._constrained(Constraint(kind="json", spec=schema, param="response_format"), n)

    def _constrained(self, constraint: Constraint, n: int) -> ContinuousGenerator:
        """The generator of a regex, a choice (with each option's score, unless answers think
        first), a Lark grammar or a JSON schema."""
        model, think, spec = self.model, self.think, constraint.spec
        build = {
            "regex": lambda sampler: generate.regex(model, spec, sampler, think=think),
            "choice": lambda sampler: generate.choice(model, spec, sampler, scores=think is None, think=think),
            "grammar": lambda sampler: generate.cfg(model, spec, sampler, think=think),
            "json": lambda sampler: generate.json(model, spec, sampler, think=think),
        }[constraint.kind]
        what, code = {"json": ("JSON schema", "invalid_json_schema")}.get(
            constraint.kind, (constraint.kind, f"invalid_{constraint.kind}"))
        return self._kept((constraint.kind, json.dumps(spec, sort_keys=True), n), build,
                          f"the {what} cannot be used", constraint.param, code)

    def tools_generator(self, tools: list[dict], tool_choice, n: int, parallel: bool = True) -> ContinuousGenerator:
        """The generator of replies that may call ``tools`` (OpenAI's dicts), built once and kept.

        ``tool_choice`` is OpenAI's (``None`` is ``"auto"``); ``parallel=False`` allows one call at most.
        """
        try:
            names = [_described(tool).name for tool in tools]
        except ValueError as exc:
            raise RequestError(f"the tools cannot be used: {exc}", param="tools", code="invalid_tools") from exc
        choice = _tool_choice(tool_choice, names)
        return self._kept(("tools", json.dumps(tools, sort_keys=True), choice, parallel, n),
                          lambda sampler: generate.tools(self.model, tools, choice, sampler, think=self.think,
                                                         parallel_tool_calls=parallel),
                          "the tools cannot be used", "tools", "invalid_tools")

    def _kept(self, key: tuple, build, refusal: str = "", param: str | None = None, code: str | None = None
              ) -> ContinuousGenerator:
        """The generator of ``key``, built (with ``n`` samples) once and kept; a failure to build it
        is the request's (``refusal``, ``param``, ``code`` say how)."""
        if key in self._generators:
            self._generators.move_to_end(key)
            return self._generators[key]
        try:
            made = build(samplers.multinomial(key[-1]))
        except Exception as exc:  # built from the request's own schema or tools: a failure is theirs
            if not refusal:
                raise
            raise RequestError(f"{refusal}: {exc}", param=param, code=code) from exc
        self._generators[key] = continuous(made)
        if len(self._generators) > GENERATORS_KEPT:
            self._generators.popitem(last=False)
        return self._generators[key]
