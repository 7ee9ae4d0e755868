"""JSON schemas as the engines take them: a document (dict or bool), from a dict, a bool or JSON text."""

from __future__ import annotations

import json

__all__ = ["document", "text", "rewritten", "validator", "place"]


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


#: Keywords whose value is a list of schemas, or a map of names to schemas.
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")
#: Keywords whose value is data (an object there is a JSON value, not a schema).
_DATA = ("enum", "const", "default", "examples")


def rewritten(node, rewrite):
    """The schema with ``rewrite`` applied to every schema in it, innermost first (a copy).

    Only schemas are visited: property names, ``enum`` and ``const`` values and the like
    are data, left as they are. An object under any other key is taken for a schema
    (``$ref`` may point anywhere in a document).
    """
    if not isinstance(node, dict):
        return node
    out = dict(node)
    for key, value in node.items():
        if key in _DATA:
            continue
        if key in _MAP and isinstance(value, dict):
            out[key] = {name: rewritten(n, rewrite) for name, n in value.items()}
        elif key in _LIST and isinstance(value, list):
            out[key] = [rewritten(n, rewrite) for n in value]
        elif isinstance(value, dict):
            out[key] = rewritten(value, rewrite)
    return rewrite(out)


def place(path) -> str:
    """A place in a JSON document, for messages: its keys and indexes (``city``, ``tags/2``)."""
    return "/".join(str(step) for step in path) or "the document"


def validator(schema):
    """A ``jsonschema`` validator of the schema's draft that checks formats it knows, and
    reads ``pattern`` and ``patternProperties`` as the engines do (``\\p{L}`` and the like),
    with the ``regex`` module rather than Python's ``re``.

    Raises
    ------
    ValueError
        When the schema is invalid.
    """
    import jsonschema
    from jsonschema import validators

    cls = validators.validator_for(schema)
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise ValueError(f"the JSON schema is invalid: {exc.message}") from exc
    cls = validators.extend(cls, {"pattern": _pattern, "patternProperties": _pattern_properties})
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def _pattern(validator, pattern, instance, schema):
    import regex
    from jsonschema import ValidationError

    if validator.is_type(instance, "string") and not regex.search(pattern, instance):
        yield ValidationError(f"{instance!r} does not match {pattern!r}")


def _pattern_properties(validator, patterns, instance, schema):
    import regex

    if validator.is_type(instance, "object"):
        for pattern, subschema in patterns.items():
            for name, value in instance.items():
                if regex.search(pattern, name):
                    yield from validator.descend(value, subschema, path=name, schema_path=pattern)
