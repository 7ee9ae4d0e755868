"""The constraint of a reply that may call tools: free text, and calls whose JSON fits a tool.

A call opens with a marker (``<tool_call>`` in the Hermes / Qwen format). Text outside
calls is free; once the marker is written, the call's JSON is held to one of the tools'
schemas until the closing marker, then text is free again. This is an llguidance lazy
grammar: the free text is a lexeme that ends at the first opening marker.
"""

from __future__ import annotations

import json

from .llguidance import LLGuidanceConstraint, lark
from .think import _special_id

__all__ = ["tool_grammar", "tool_calls"]

#: What a call's JSON looks like: ``{"name": "f", "arguments": {...}}`` on one line, as
#: ``json.dumps`` and the chat templates write it.
_LAYOUT = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


def _marker(tokenizer, text: str) -> str:
    """A marker in the grammar: its special token, or its text."""
    special = _special_id(tokenizer, text)
    return f"<[{special}]>" if special is not None else json.dumps(text)


def tool_grammar(schema: dict, open: str, close: str, tokenizer, *, call_first: bool) -> str:
    """The Lark grammar (llguidance's dialect) of text and calls.

    Parameters
    ----------
    schema
        The JSON schema of one call (an ``anyOf`` over the tools).
    open, close
        The markers around a call.
    call_first
        The reply starts with a call (``tool_choice="required"`` or a tool's name);
        otherwise calls are optional.
    """
    opening = _marker(tokenizer, open)
    if opening.startswith("<["):
        head = f"head: TEXT {opening}"
    else:  # a lazy lexeme: the free text ends at the first opening marker
        head = f"head[lazy]: TEXT {opening}"
    first = f"{opening} body " if call_first else ""
    return "\n".join([
        "%llguidance {}",
        f"start: {first}(head body)* TEXT",
        head,
        f'body: "\\n"? call "\\n"? {_marker(tokenizer, close)}',
        f"call: %json {json.dumps({**schema, 'x-guidance': _LAYOUT})}",
        "TEXT: /(?s:.*)/",
        "",
    ])


def tool_calls(schema: dict, open: str, close: str, tokenizer, *, call_first: bool) -> LLGuidanceConstraint:
    """The compiled constraint of :func:`tool_grammar` (cached per grammar and tokenizer)."""
    return lark(tool_grammar(schema, open, close, tokenizer, call_first=call_first), tokenizer)
