"""The constraint of a reply that may call tools: free text, and calls whose JSON fits a tool.

A call opens with a marker (``<tool_call>`` in the Hermes / Qwen format, ``[TOOL_CALLS]``
in Mistral's, a reply's first ``{`` in Llama 3.1's). Text outside calls is free; once the
marker is written, the call's JSON is held to one of the tools' schemas (until the
closing marker, then text is free again). This is an llguidance lazy grammar: the free
text is a lexeme that ends at the first opening marker.

:func:`read_calls` reads what the grammar lets a model write (whole, or as far as it
is written), so that a reply's calls are exactly those the grammar held to a schema.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from .llguidance import LLGuidanceConstraint, lark
from .think import _special_id

__all__ = ["CallFormat", "HERMES", "LLAMA3", "MISTRAL", "tool_grammar", "tool_calls", "Written", "WrittenCall",
           "read_calls"]

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


def _without(marker: str) -> str:
    """A lexeme of free text that never holds ``marker``'s text."""
    literal = "".join(f"\\{c}" if c in r"\/.^$*+?()[]{}|-" else c for c in marker)
    return f"/(?s:.*)/ & ~/(?s:.*){literal}(?s:.*)/"


def tool_grammar(schema: dict, form: CallFormat, tokenizer, *, call_first: bool, parallel: bool = True) -> str:
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
    parallel
        Whether a reply may hold more than one call.
    """
    if form.name == "llama3":  # a reply whose first non-blank character is "{" is a call, and nothing else
        start = "start: call" if call_first else "start: call | FREE\nFREE: /\\s*([^{\\s](?s:.*))?/"
        return f"%llguidance {{}}\n{start}\ncall: /\\s*/ {_json(schema)}\n"
    opening = _marker(tokenizer, form.open)
    # A lazy lexeme: the free text ends at the first opening marker (a special token ends it anyway).
    head = "head" if opening.startswith("<[") else "head[lazy]"
    lines = ["%llguidance {}", "TEXT: /(?s:.*)/", f"{head}: TEXT {opening}"]
    if form.name == "mistral":  # one list of calls, at the end
        defs = {k: v for k, v in schema.items() if k == "$defs"}  # references point at the root
        items = {k: v for k, v in schema.items() if k != "$defs"}
        most = {} if parallel else {"maxItems": 1}
        lines += [f"calls: {_json({'type': 'array', 'items': items, 'minItems': 1, **most, **defs})}",
                  f"start: {opening} calls" if call_first else "start: TEXT | head calls"]
        return "\n".join(lines + [""])
    lines += [f"call: {_json(schema)}", f'body: "\\n"? call "\\n"? {_marker(tokenizer, form.close)}']
    if parallel:
        first = f"{opening} body " if call_first else ""
        lines.append(f"start: {first}(head body)* TEXT")
    else:  # after the one call, text that never opens another
        lines += [f"TAIL: {_without(form.open)}", f"start: {opening} body TAIL" if call_first
                  else "start: (head body)? TAIL"]
    return "\n".join(lines + [""])


def tool_calls(schema: dict, form: CallFormat, tokenizer, *, call_first: bool, parallel: bool = True
               ) -> LLGuidanceConstraint:
    """The compiled constraint of :func:`tool_grammar` (cached per grammar and tokenizer)."""
    return lark(tool_grammar(schema, form, tokenizer, call_first=call_first, parallel=parallel), tokenizer)


@dataclass
class WrittenCall:
    """One call as far as it is written.

    Attributes
    ----------
    name
        The tool's name, once written whole (else ``None``).
    arguments
        The arguments' JSON text as the model wrote it, so far.
    done
        Whether the call is written whole, its closing marker (or list's end) included.
    """

    name: str | None = None
    arguments: str = ""
    done: bool = False


@dataclass
class Written:
    """A reply as far as it is written: ``text`` outside calls (joined, unstripped) and the ``calls``."""

    text: str = ""
    calls: list[WrittenCall] = field(default_factory=list)


def read_calls(text: str, form: CallFormat, *, final: bool = True) -> Written:
    """The text and calls of a reply that :func:`tool_grammar` allowed, whole or as far as written.

    Parameters
    ----------
    text
        The reply (after the prompt and any thinking section).
    form
        How calls are written.
    final
        Whether the reply is over. While it is not, text that may still turn out to open
        a call (part of an opening marker, a Llama reply's leading blanks) is left out.
    """
    if form.name == "llama3":
        body = text.lstrip()
        if not body.startswith("{"):  # text, unless a reply of blanks so far is still to show
            return Written(text if body or final else "")
        call, end = _call(text, len(text) - len(body), form.arguments)
        call.done = end == len(text)
        return Written("", [call])
    at = text.find(form.open)
    if at < 0:
        return Written(text if final else text[:len(text) - _opening_part(text, form.open)])
    if form.name == "mistral":
        return Written(text[:at], _listed(text, at + len(form.open), form.arguments))
    written, pos = Written(), 0
    while at >= 0:
        written.text += text[pos:at]
        start = at + len(form.open)
        call, end = _call(text, start + text.startswith("\n", start), form.arguments)
        written.calls.append(call)
        if end is None:
            return written
        end += text.startswith("\n", end)
        if not text.startswith(form.close, end):
            return written
        call.done, pos = True, end + len(form.close)
        at = text.find(form.open, pos)
    rest = text[pos:]
    written.text += rest if final else rest[:len(rest) - _opening_part(rest, form.open)]
    return written


def _opening_part(text: str, marker: str) -> int:
    """The length of ``text``'s longest ending that begins ``marker`` (0 if none)."""
    return next((k for k in range(min(len(text), len(marker) - 1), 0, -1) if marker.startswith(text[-k:])), 0)


def _listed(text: str, at: int, key: str) -> list[WrittenCall]:
    """A Mistral list of calls that opens at ``at``, as far as written."""
    calls: list[WrittenCall] = []
    if not text.startswith("[", at):
        return calls
    at += 1
    while True:
        call, end = _call(text, at, key)
        calls.append(call)
        if end is None:
            return calls
        if text.startswith("]", end):
            call.done = True
            return calls
        if not text.startswith(", ", end):
            return calls
        call.done, at = True, end + 2


_DECODER = json.JSONDecoder()


def _call(text: str, at: int, key: str) -> tuple[WrittenCall, int | None]:
    """The call whose JSON starts at ``at``, and where its JSON ends (``None`` until written whole).

    The grammar writes ``{"name": ..., KEY: ...}`` in that order and layout, so the
    arguments are the text between that head and the call's last brace.
    """
    head = re.compile(r'\{"name": ("(?:[^"\\]|\\.)*"), ' + re.escape(json.dumps(key)) + ": ").match(text, at)
    if head is None:
        return WrittenCall(), None
    call = WrittenCall(json.loads(head.group(1)), text[head.end():])
    try:
        _, end = _DECODER.raw_decode(text, head.end())
    except ValueError:  # the arguments are not written whole yet
        return call, None
    call.arguments = text[head.end():end]
    return call, end + 1 if text.startswith("}", end) else None
