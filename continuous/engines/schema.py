"""JSON schemas as the engines take them: a document (dict or bool), from a dict, a bool or JSON text."""

from __future__ import annotations

import json

__all__ = ["document", "text", "rewritten"]


def document(schema) -> dict | bool:
    """The schema as a document.

    Raises
    ------
    ValueError
        For text that is not JSON.
    TypeError
        For anything but a dict, a bool or a str.
    """
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise ValueError(f"the JSON schema string is not valid JSON: {exc}") from exc
    if not isinstance(schema, (dict, bool)):
        raise TypeError(f"a JSON schema is a dict, a bool or a JSON string, not {type(schema).__name__}")
    return schema


def text(schema) -> str:
    """The schema as JSON text, keys in their order (llguidance emits properties in the order given)."""
    return json.dumps(document(schema))


def rewritten(node, rewrite):
    """The schema with ``rewrite`` applied to every object node, innermost first."""
    if isinstance(node, list):
        return [rewritten(n, rewrite) for n in node]
    if not isinstance(node, dict):
        return node
    return rewrite({k: rewritten(v, rewrite) for k, v in node.items()})
