"""Tool calls in the model's own format: free text, and calls held to the tools' schemas.

The call's form is the chat template's own where the template renders tools: Hermes /
Qwen (``<tool_call>{"name": ..., "arguments": ...}</tool_call>``), Llama 3.1 (the reply is
``{"name": ..., "parameters": ...}``) or Mistral (``[TOOL_CALLS][{"name": ...,
"arguments": ...}]``). Where the template does not render tools, the Hermes form is the
default, and :meth:`ToolsGenerator.prompt` writes the tools and how to call them into
the system prompt.
"""

from __future__ import annotations

import inspect
import json as _json
from dataclasses import dataclass, fields
from functools import partial
from typing import Any, Callable

from pydantic import BaseModel

from .. import chat
from ..chat import _template_form
from ..engines.tools import HERMES, CallFormat, Written, read_calls, tool_calls
from ..engines.schema import closed
from .base import SequenceGenerator, check_model, make

__all__ = ["tools", "Reply", "ToolCall", "ToolsGenerator"]

_DEFAULT_PROMPT = ("You can call tools. To call one, write {open}{{\"name\": <the tool's name>, \"arguments\": "
                   "<its arguments as a JSON object>}}{close}. The tools, as JSON schemas:\n{tools}")


@dataclass(frozen=True)
class ToolCall:
    """One call: the tool's ``name`` and its ``arguments`` (the tool's pydantic model, or a
    dict for a function)."""

    name: str
    arguments: Any


@dataclass(frozen=True)
class Reply:
    """What a model answered: its ``text`` outside calls (joined, surrounding whitespace
    stripped), and its ``calls`` in order."""

    text: str
    calls: list[ToolCall]


@dataclass(frozen=True)
class _Tool:
    name: str
    description: str
    parameters: dict
    parse: Callable[[dict], Any]

    def spec(self) -> dict:
        """The tool as chat templates and OpenAI's API take it."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


def _tool(spec) -> _Tool:
    """A tool from a pydantic model or a function (its signature and docstring)."""
    if isinstance(spec, type) and issubclass(spec, BaseModel):
        return _Tool(spec.__name__, _summary(spec), closed(spec.model_json_schema()), spec.model_validate)
    if inspect.isfunction(spec) or inspect.ismethod(spec):
        from outlines.types.utils import get_schema_from_signature

        schema = {k: v for k, v in get_schema_from_signature(spec).items() if k != "title"}
        return _Tool(spec.__name__, _summary(spec), closed(schema), dict)
    raise TypeError(f"a tool is a function or a pydantic model class, got {spec!r}")


def _described(spec: dict) -> _Tool:
    """A tool described as OpenAI's API and chat templates take it: ``{"type": "function",
    "function": {"name", "description", "parameters"}}``, or the inner object alone; its
    arguments come back as a dict. Its objects take only the members they name, unless
    they say otherwise, as ``generate.json``'s do."""
    inner = spec.get("function", spec) if spec.get("type", "function") == "function" else None
    name = inner.get("name") if isinstance(inner, dict) else None
    if not isinstance(name, str) or not name:
        raise ValueError(f"a tool given as a dict needs a function with a name, got {spec!r}")
    parameters = inner.get("parameters") or {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise ValueError(f"the parameters of tool {name!r} must be a JSON schema object, got {parameters!r}")
    return _Tool(name, str(inner.get("description") or ""), closed(parameters), dict)


def _summary(obj) -> str:
    """The first paragraph of a docstring (pydantic's default one excepted)."""
    doc = inspect.getdoc(obj) or ""
    if doc == inspect.getdoc(BaseModel):  # a model without its own docstring inherits pydantic's
        return ""
    return doc.split("\n\n")[0].strip()


def _call_schema(tools: list[_Tool], arguments: str) -> dict:
    """One call of any of the tools, with every tool's definitions at the root."""
    defs: dict[str, Any] = {}
    branches = []
    for tool in tools:
        parameters = dict(tool.parameters)
        for name, definition in parameters.pop("$defs", {}).items():
            if defs.setdefault(name, definition) != definition:
                raise ValueError(f"two tools define different types named {name!r}: rename one")
        branches.append({"type": "object", "properties": {"name": {"const": tool.name}, arguments: parameters},
                         "required": ["name", arguments], "additionalProperties": False})
    schema = {"anyOf": branches}
    return {**schema, "$defs": defs} if defs else schema


@dataclass(frozen=True, eq=False)
class ToolsGenerator(SequenceGenerator):
    """A generator of replies that may call tools; :meth:`prompt` shows the model its tools.

    Attributes
    ----------
    tools
        The tools, in order, each with its name, description and JSON schema.
    form
        How calls are written (:class:`~continuous.engines.tools.CallFormat`).
    own_format
        Whether the chat template renders tools itself (else the default, Hermes form is
        written into the system prompt).
    tool_choice
        ``"auto"``, ``"required"``, ``"none"`` or a tool's name, as given.
    """

    tools: tuple = ()
    form: CallFormat = HERMES
    own_format: bool = False
    tool_choice: str = "auto"

    def read(self, text: str, final: bool = True) -> Written:
        """A reply's text and calls as the model wrote them, whole or (``final=False``) as far as
        written: each call's name and its arguments' JSON text (see
        :func:`~continuous.engines.tools.read_calls`). With ``tool_choice="none"`` all is text."""
        return read_calls(text, self.form, final=final) if self.tool_choice != "none" else Written(text)

    def prompt(self, messages: list[dict], **template_kwargs) -> str:
        """The conversation's text in the chat template, with the tools the model may call.

        The template renders them where it can; otherwise a system message describes them and
        the call's form (added to the first message where that is a system message).
        """
        if self.own_format:
            return chat.prompt(self.model, messages, tools=[t.spec() for t in self.tools], **template_kwargs)
        text = _DEFAULT_PROMPT.format(open=HERMES.open, close=HERMES.close, tools="\n".join(
            _json.dumps({"name": t.name, "description": t.description, "parameters": t.parameters})
            for t in self.tools))
        messages = [dict(m) for m in messages]
        if messages and messages[0].get("role") == "system":
            messages[0]["content"] = f"{messages[0]['content']}\n\n{text}"
        else:
            messages.insert(0, {"role": "system", "content": text})
        return chat.prompt(self.model, messages, **template_kwargs)


class _ParseReply:
    """A reply's text and calls, the arguments parsed into the tools' types."""

    def __init__(self, tools: list[_Tool], form: CallFormat, calls: bool):
        self.tools, self.form, self.calls = {t.name: t for t in tools}, form, calls

    def __call__(self, text: str) -> Reply:
        if not self.calls:
            return Reply(text.strip(), [])
        written = read_calls(text, self.form)
        calls = []
        for call in written.calls:
            if not call.done:
                raise ValueError(f"a call is not written whole: {text!r}")
            tool = self.tools[call.name]
            calls.append(ToolCall(tool.name, tool.parse(_json.loads(call.arguments))))
        return Reply(written.text.strip(), calls)


def tools(model, tools: list, tool_choice: str = "auto", sampler=None, *, parallel_tool_calls: bool = True,
          ban=None, ban_case=False, think=None) -> ToolsGenerator:
    """Replies in free text that may call tools; ``value`` is a :class:`Reply`.

    Parameters
    ----------
    model
        A model from ``continuous.models``.
    tools
        Functions (their signature gives the arguments' schema, their docstring's first
        paragraph the description), pydantic model classes (the arguments are an
        instance) or OpenAI-style dicts ``{"type": "function", "function": {"name",
        "description", "parameters"}}`` (the schema as given; the arguments are a dict);
        names must differ.
    tool_choice
        ``"auto"`` (text, calls, or both), ``"required"`` (the reply starts with a call),
        ``"none"`` (text only) or a tool's name (the reply starts with a call of that
        tool; later calls are of it too).
    parallel_tool_calls
        Whether a reply may hold more than one call (``False``: at most one).
    sampler, ban, ban_case, think
        As for every generator.

    Returns
    -------
    ToolsGenerator
        Wrap it with :func:`continuous.continuous`; its :meth:`~ToolsGenerator.prompt`
        renders a conversation with the tools.

    Raises
    ------
    ValueError
        When ``tools`` is empty, two tools share a name, or ``tool_choice`` names no tool.
    """
    check_model(model)
    if not isinstance(tools, (list, tuple)) or not tools:
        raise ValueError(f"tools must be a non-empty list of functions, pydantic models or tool dicts, got {tools!r}")
    made = [_described(t) if isinstance(t, dict) else _tool(t) for t in tools]
    names = [t.name for t in made]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"tool names must differ: {', '.join(map(repr, twice))} given more than once")
    if tool_choice not in ("auto", "required", "none", *names):
        raise ValueError(f"tool_choice must be 'auto', 'required', 'none' or a tool's name {names}, "
                         f"got {tool_choice!r}")
    own = _template_form(model.tokenizer)
    form = own or HERMES
    callable_tools = [t for t in made if tool_choice in ("auto", "required", t.name)]
    constraint = None
    if tool_choice != "none":
        schema = _call_schema(callable_tools, form.arguments)
        constraint = partial(tool_calls, schema, form, call_first=tool_choice != "auto", parallel=parallel_tool_calls)
    base = make(model, sampler, constraint, _ParseReply(made, form, tool_choice != "none"), kind="tools", ban=ban,
                ban_case=ban_case, think=think)
    values = {f.name: getattr(base, f.name) for f in fields(SequenceGenerator)}
    return ToolsGenerator(**values, tools=tuple(made), form=form, own_format=own is not None,
                          tool_choice=tool_choice)
