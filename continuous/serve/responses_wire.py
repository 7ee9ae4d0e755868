"""The wire types of ``/v1/responses``: OpenAI's Responses request, its input items, its output
items, the response and its stream events, as pydantic models.

The request and its items refuse fields they do not know, as the other endpoints' do. Input
items accept the fields of the output items they may echo (``id``, ``status``...), so that an
agent loop can send a response's ``output`` back as the next request's input.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .wire import TokenLogprob

__all__ = [
    "ResponsesRequest", "TextConfig", "TextFormat", "FunctionTool", "ReasoningConfig",
    "InputPart", "InputMessage", "FunctionCallItem", "FunctionCallOutputItem", "ReasoningInput", "INPUT_ITEMS",
    "OutputText", "OutputMessage", "FunctionCall", "ReasoningText", "Reasoning", "ResponseUsage",
    "InputTokensDetails", "OutputTokensDetails", "IncompleteDetails", "ResponseError", "Response", "StreamEvent",
]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


# ------------------------------------------------------------------ requests
class TextFormat(_Strict):
    """``text.format``: ``text``, ``json_object`` (any JSON object) or ``json_schema``."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, max_length=64)
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if (self.type == "json_schema") != (self.schema_ is not None):
            raise ValueError("schema is given exactly when type is 'json_schema'")
        return self


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted, no effect


class FunctionTool(_Strict):
    """A function the model may call (the only kind of tool a served model can use)."""

    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ReasoningConfig(_Strict):
    """``reasoning``: accepted; whether the model thinks is the server's ``--think``."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class StreamOptions(_Strict):
    include_obfuscation: bool | None = None  # accepted, no effect: nothing is padded


class ResponsesRequest(_Strict):
    """``POST /v1/responses``. Input items are checked one by one by the endpoint, which
    names the item at fault."""

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = None  # not OpenAI's (vLLM's too): makes sampling reproducible
    stream: bool = False
    stream_options: StreamOptions | None = None
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning: ReasoningConfig | None = None
    previous_response_id: str | None = None  # refused by the endpoint: the server keeps no responses
    truncation: Literal["disabled"] | None = None  # "auto" would drop input the server must not drop
    # Log-probabilities come with "message.output_text.logprobs"; the reasoning comes as text, never encrypted.
    include: list[Literal["message.output_text.logprobs", "reasoning.encrypted_content"]] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    background: Literal[False] | None = None
    # Accepted, with no effect on the output: clients send them routinely.
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    @model_validator(mode="after")
    def _stream_options(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options needs stream: true")
        return self

    @property
    def logprobs(self) -> int | None:
        """The alternatives wanted beside each token's log-probability (``None``: no log-probabilities)."""
        return (self.top_logprobs or 0) if "message.output_text.logprobs" in (self.include or ()) else None

    @property
    def format(self) -> TextFormat | None:
        return self.text.format if self.text is not None else None


class InputPart(_Strict):
    """A text part of an input message (``output_text``: an earlier answer sent back)."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


def _parts(content):
    """A message's content as parts: a string is one text part."""
    return [{"type": "input_text", "text": content}] if isinstance(content, str) else content


class InputMessage(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: list[InputPart]
    id: str | None = None
    status: str | None = None
    phase: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _as_parts(cls, content):
        return _parts(content)

    @property
    def text(self) -> str:
        return "".join(part.text for part in self.content)


class FunctionCallItem(_Strict):
    """A call the model made, sent back so that the next turn sees it."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Strict):
    """What a call returned."""

    type: Literal["function_call_output"]
    call_id: str
    output: list[InputPart]
    id: str | None = None
    status: str | None = None

    @field_validator("output", mode="before")
    @classmethod
    def _as_parts(cls, output):
        return _parts(output)

    @property
    def text(self) -> str:
        return "".join(part.text for part in self.output)


class ReasoningInput(_Strict):
    """An earlier response's thinking, sent back: skipped, as chat templates drop past thinking."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[Any] = []
    content: list[Any] | None = None
    encrypted_content: str | None = None
    status: str | None = None


#: The input items read, by ``type`` (a message may leave its type out).
INPUT_ITEMS = {"message": InputMessage, "function_call": FunctionCallItem,
               "function_call_output": FunctionCallOutputItem, "reasoning": ReasoningInput}


# ------------------------------------------------------------------ responses
class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str = ""
    annotations: list[Any] = []
    logprobs: list[TokenLogprob] | None = None


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: str = "in_progress"
    content: list[OutputText] = []


class FunctionCall(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    status: str = "in_progress"
    call_id: str
    name: str
    arguments: str = ""


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str = ""


class Reasoning(BaseModel):
    id: str
    type: Literal["reasoning"] = "reasoning"
    status: str = "in_progress"
    summary: list[Any] = []
    content: list[ReasoningText] = []


class InputTokensDetails(BaseModel):
    cached_tokens: int


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseError(BaseModel):
    code: str
    message: str


class Response(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    completed_at: int | None = None
    model: str
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    output: list[Reasoning | OutputMessage | FunctionCall] = []
    usage: ResponseUsage | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    # The request's options, echoed as OpenAI echoes them.
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] = []
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] = {}
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    store: bool = False  # nothing is kept: the server is stateless


class StreamEvent(BaseModel):
    """One server-sent event of a streamed response (the fields its ``type`` has)."""

    type: str
    sequence_number: int
    response: dict[str, Any] | None = None
    output_index: int | None = None
    item_id: str | None = None
    content_index: int | None = None
    item: dict[str, Any] | None = None
    part: dict[str, Any] | None = None
    delta: str | None = None
    text: str | None = None
    arguments: str | None = None
    logprobs: list[Any] | None = None
