"""The server's wire types: OpenAI's request and response bodies, as pydantic models.

Requests refuse fields they do not know (a typo is an error, not a silent default) and
check every bound here, so that the routes get only values the library accepts.
Responses are built from these types, so their shape is checked too.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = [
    "FieldError", "StructuredOutputs", "Constraint", "ChatRequest", "TokenizeRequest", "DetokenizeRequest",
    "TokenizeResponse", "DetokenizeResponse", "CompletionRequest", "Message", "ResponseFormat",
    "JsonSchemaFormat", "StreamOptions", "TokenLogprob", "TopLogprob", "ChoiceLogprobs", "CompletionLogprobs",
    "Usage", "PromptTokensDetails", "ChatMessage", "ChatChoice", "ChatCompletion", "ChatDelta",
    "ChatChunkChoice", "ChatCompletionChunk", "CompletionChoice", "Completion", "ModelCard", "ModelList",
    "ErrorBody", "ErrorResponse", "param_code", "place",
]


class FieldError(ValueError):
    """A refusal that names the field it is about (OpenAI's ``param``), for checks across fields,
    whose place pydantic cannot tell."""

    def __init__(self, param: str, message: str, code: str = "invalid_value"):
        super().__init__(message)
        self.param, self.code = param, code


#: OpenAI's ``code`` of a pydantic error kind (others: ``invalid_type`` or ``invalid_value``).
CODES = {"missing": "missing_required_parameter", "extra_forbidden": "unknown_parameter"}


def param_code(error: dict) -> tuple[str | None, str]:
    """OpenAI's ``param`` and ``code`` of a validation error: where it is, and what kind it is."""
    refusal = error.get("ctx", {}).get("error")
    if isinstance(refusal, FieldError):  # a check across fields names its own
        return refusal.param, refusal.code
    param = place(error)
    if param is None:
        return None, "invalid_body"  # the body as a whole: not an object
    kind = error.get("type", "")
    return param, CODES.get(kind, "invalid_type" if kind.endswith("_type") else "invalid_value")


def place(error: dict) -> str | None:
    """Where in the body a validation error is, as OpenAI's ``param`` names it (``messages.0.role``)."""
    return ".".join(str(p) for p in error.get("loc", ()) if p != "body") or None


class _Strict(BaseModel):
    # strict: a number sent as a string ("max_tokens": "5") is refused, as OpenAI refuses it.
    model_config = ConfigDict(extra="forbid", populate_by_name=True, strict=True)


# ------------------------------------------------------------------ requests
class TextPart(_Strict):
    """A text part of a message's content (the only kind a text model reads)."""

    type: Literal["text"]
    text: str


class Message(_Strict):
    """A chat message. ``tool_calls`` and ``tool_call_id`` are kept for the chat template."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    # The assistant's earlier calls and the tools' answers go to the chat template as they are.
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates read it: ``developer`` is a system message, parts are joined."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        out = {"role": "system" if self.role == "developer" else self.role, "content": content or ""}
        out.update({k: v for k, v in (("name", self.name), ("tool_calls", self.tool_calls),
                                      ("tool_call_id", self.tool_call_id)) if v is not None})
        return out


class JsonSchemaFormat(_Strict):
    """``response_format.json_schema``: the schema the answer must match."""

    name: str = Field(max_length=64)
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(_Strict):
    """``text``, ``json_object`` (any JSON object) or ``json_schema``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise FieldError("response_format", "json_schema is given exactly when type is 'json_schema'")
        return self


class StructuredOutputs(_Strict):
    """``structured_outputs``: the answer matches a regex, is one of ``choice``, is in a Lark
    grammar's language, or is JSON of a schema (give one)."""

    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None
    json_: dict[str, Any] | str | None = Field(None, alias="json")

    @model_validator(mode="after")
    def _one(self):
        given = [k for k in ("regex", "choice", "grammar", "json_") if getattr(self, k) is not None]
        if len(given) != 1:
            raise FieldError("structured_outputs", "structured_outputs holds one of regex, choice, grammar or json, "
                             f"got {len(given)}")
        return self

    @field_validator("json_")
    @classmethod
    def _schema(cls, schema):
        return _schema(schema)


def _schema(schema: dict | str | None) -> dict | None:
    """A JSON schema given as an object or as its JSON text (vLLM takes both)."""
    if not isinstance(schema, str):
        return schema
    try:
        parsed = json.loads(schema)
    except ValueError as exc:
        raise ValueError(f"the JSON schema is not JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise ValueError("a JSON schema is an object")
    return parsed


class Constraint(BaseModel):
    """The one constraint a request asks for: ``kind`` (``regex``, ``choice``, ``grammar`` or
    ``json``), its ``spec``, and the field that gave it (``param``, for refusals)."""

    kind: Literal["regex", "choice", "grammar", "json"]
    spec: Any
    param: str


class StreamOptions(_Strict):
    include_usage: bool = False


class _Request(_Strict):
    """What chat and text completions share."""

    model: str
    n: int = Field(1, ge=1, le=128)
    max_tokens: int | None = Field(None, ge=0)
    stop: str | list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)  # what torch.Generator takes
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    # Our constraints, as vLLM names them (guided_*: its older names, which clients still send).
    structured_outputs: StructuredOutputs | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_grammar: str | None = None
    guided_json: dict[str, Any] | str | None = None
    # Accepted, with no effect on the output: clients send them routinely.
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # Sampling controls as OpenAI defines them (logit_bias: token id, as a string -> bias).
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop):
        stops = [stop] if isinstance(stop, str) else stop
        if stops is not None and not all(stops):
            raise ValueError("a stop string may not be empty")
        return stop

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, bias):
        for token, value in (bias or {}).items():
            if not token.isdigit():
                raise ValueError(f"logit_bias is keyed by token ids, got {token!r}")
            if not -100 <= value <= 100:
                raise ValueError(f"a logit bias is between -100 and 100, got {value} for token {token}")
        return bias

    @model_validator(mode="after")
    def _stream_options(self):
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options", "stream_options needs stream: true")
        return self

    @model_validator(mode="after")
    def _one_constraint(self):
        given = self._constraints()
        if len(given) > 1:
            raise FieldError(given[1].param, f"give one constraint per request: {given[0].param} and "
                             f"{given[1].param} are both given")
        return self

    @field_validator("guided_json")
    @classmethod
    def _schema(cls, schema):
        return _schema(schema)

    def _constraints(self) -> list[Constraint]:
        """Every constraint the request gives (tools and response formats included)."""
        out = []
        if getattr(self, "tools", None):
            out.append(Constraint(kind="json", spec=None, param="tools"))
        if self.response_format is not None and self.response_format.type != "text":
            out.append(Constraint(kind="json", spec=None, param="response_format"))
        if self.structured_outputs is not None:
            out += [Constraint(kind=k.rstrip("_"), spec=v, param=f"structured_outputs.{k.rstrip('_')}")
                    for k, v in self.structured_outputs if v is not None]
        out += [Constraint(kind=k, spec=v, param=f"guided_{k}")
                for k in ("regex", "choice", "grammar", "json") if (v := getattr(self, f"guided_{k}")) is not None]
        return out

    @property
    def constraint(self) -> Constraint | None:
        """The request's ``structured_outputs`` or ``guided_*`` constraint, if one."""
        given = [c for c in self._constraints() if c.param not in ("response_format", "tools")]
        return given[0] if given else None

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or ())


class ChatRequest(_Request):
    """``POST /v1/chat/completions``."""

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # Functions the model may call, and which (generate.tools); their shapes are OpenAI's.
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _one_limit(self):
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise FieldError("max_completion_tokens", "give max_tokens or max_completion_tokens, not both")
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldError("top_logprobs", "top_logprobs needs logprobs: true")
        return self

    @model_validator(mode="after")
    def _answered_calls(self):
        """Each tool message answers a call of an earlier assistant message."""
        called: set[str] = set()
        for i, message in enumerate(self.messages):
            called.update(str(c.get("id")) for c in message.tool_calls or () if c.get("id") is not None)
            if message.role == "tool" and message.tool_call_id not in called:
                said = "has no tool_call_id" if message.tool_call_id is None else \
                    f"answers {message.tool_call_id!r}, which no earlier assistant message called"
                raise FieldError(f"messages.{i}.tool_call_id", f"the tool message {said}")
        return self

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Request):
    """``POST /v1/completions``."""

    prompt: str | list[str] = Field(min_length=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: Literal[False] = False
    suffix: None = None
    best_of: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _best_of(self):
        if self.best_of is not None and self.best_of != self.n:
            raise FieldError("best_of", "best_of other than n is not supported")
        return self

    @property
    def limit(self) -> int | None:
        # OpenAI's legacy completions stop at 16 tokens unless told otherwise.
        return 16 if self.max_tokens is None else self.max_tokens


class TokenizeRequest(_Strict):
    """``POST /tokenize``: a prompt (``content`` is llama.cpp's name for it) or chat messages."""

    model: str | None = None
    prompt: str | None = None
    content: str | None = None
    messages: list[Message] | None = Field(None, min_length=1)
    add_special_tokens: bool = True  # a prompt's BOS (messages: the chat template decides)
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        given = [k for k in ("prompt", "content", "messages") if getattr(self, k) is not None]
        if len(given) != 1:
            raise FieldError(given[-1] if given else "prompt", "give one of prompt, content or messages",
                             "invalid_value" if given else "missing_required_parameter")
        return self


class DetokenizeRequest(_Strict):
    """``POST /detokenize``: token ids back to text."""

    model: str | None = None
    tokens: list[int]


# ------------------------------------------------------------------ responses
class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob]


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] = []
    text_offset: list[int] = []


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class ChatMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[dict[str, Any]] | None = None  # the calls of a reply to a request with tools
    reasoning_content: str | None = None  # the thinking of a server started with --think


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    finish_reason: str | None
    logprobs: ChoiceLogprobs | None = None
    choice_scores: dict[str, float] | None = None  # each option's log-probability (structured choice)


class _Answer(BaseModel):
    """What every answer and chunk says of itself."""

    id: str
    created: int
    model: str


class ChatCompletion(_Answer):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    reasoning_content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None
    choice_scores: dict[str, float] | None = None


class ChatCompletionChunk(_Answer):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None
    choice_scores: dict[str, float] | None = None


class Completion(_Answer):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str
    content: str  # llama.cpp's name


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "continuous"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody
