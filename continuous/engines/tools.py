"""The constraint of a reply that may call tools: free text, and calls whose JSON fits a tool.

A call opens with a marker (``<tool_call>`` in the Hermes / Qwen format, ``[TOOL_CALLS]``
in Mistral's, a reply's first ``{`` in Llama 3.1's). Text outside calls is free; once the
marker is written, the call's JSON is held to one of the tools' schemas (until the
closing marker, then text is free again). This is an llguidance lazy grammar: the free
text is a lexeme that ends at the first opening marker.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from .llguidance import LLGuidanceConstraint, lark
from .think import _special_id

__all__ = ["CallFormat", "HERMES", "LLAMA3", "MISTRAL", "tool_grammar", "tool_calls"]

#: What a call's JSON looks like: ``{"name": "f", "arguments": {...}}`` on one line, as
#: ``json.dumps`` and the chat templates write it.
_LAYOUT = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


def _marker(tokenizer, text: str) -> str:
    """A marker in the grammar: its special token, or its text."""
    special = _special_id(tokenizer, text)
    return f"<[{special}]>" if special is not None else json.dumps(text)


@dataclass(frozen=True)
class CallFormat:
    """How a model writes its calls.

    Attributes
    ----------
    name
        ``"hermes"`` (Hermes, Qwen: each call between ``<tool_call>`` and ``</tool_call>``,
        text around), ``"llama3"`` (Llama 3.1: the whole reply is one JSON call, or text
        that does not start with ``{``) or ``"mistral"`` (text, then ``[TOOL_CALLS]`` and a
        JSON list of calls).
    open, close
        The markers around a call (``""`` where there is none).
    arguments
        The key of a call's arguments (``"arguments"``, or Llama's ``"parameters"``).
    """

    name: str
    open: str
    close: str
    arguments: str


HERMES = CallFormat("hermes", "<tool_call>", "</tool_call>", "arguments")
LLAMA3 = CallFormat("llama3", "", "", "parameters")
MISTRAL = CallFormat("mistral", "[TOOL_CALLS]", "", "arguments")


def _json(schema: dict) -> str:
    return f"%json {json.dumps({**schema, 'x-guidance': _LAYOUT})}"


def tool_grammar(schema: dict, form: CallFormat, tokenizer, *, call_first: bool) -> str:
    """The Lark grammar (llguidance's dialect) of text and calls.

    Parameters
    ----------
    schema
        The JSON schema of one call (an ``anyOf`` over the tools).
    form
        How calls are written.
    call_first
        The reply starts with a call (``tool_choice="required"`` or a tool's name);
        otherwise calls are optional.
    """
    if form.name == "llama3":  # a reply that starts with "{" is a call, and nothing else
        start = "start: call" if call_first else "start: call | FREE\nFREE: /([^{](?s:.*))?/"
        return f"%llguidance {{}}\n{start}\ncall: {_json(schema)}\n"
    opening = _marker(tokenizer, form.open)
    # A lazy lexeme: the free text ends at the first opening marker (a special token ends it anyway).
    head = "head" if opening.startswith("<[") else "head[lazy]"
    lines = ["%llguidance {}", "TEXT: /(?s:.*)/", f"{head}: TEXT {opening}"]
    if form.name == "mistral":  # one list of calls, at the end
        defs = {k: v for k, v in schema.items() if k == "$defs"}  # references point at the root
        items = {k: v for k, v in schema.items() if k != "$defs"}
        lines += [f"calls: {_json({'type': 'array', 'items': items, 'minItems': 1, **defs})}",
                  f"start: {opening} calls" if call_first else "start: TEXT | head calls"]
    else:
        first = f"{opening} body " if call_first else ""
        lines += [f"call: {_json(schema)}", f'body: "\\n"? call "\\n"? {_marker(tokenizer, form.close)}',
                  f"start: {first}(head body)* TEXT"]
    return "\n".join(lines + [""])


def tool_calls(schema: dict, form: CallFormat, tokenizer, *, call_first: bool) -> LLGuidanceConstraint:
    """The compiled constraint of :func:`tool_grammar` (cached per grammar and tokenizer)."""
    return lark(tool_grammar(schema, form, tokenizer, call_first=call_first), tokenizer)
