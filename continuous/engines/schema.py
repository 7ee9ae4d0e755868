"""JSON schemas as the engines take them: a document (a dict), from a dict, a bool or JSON text."""

from __future__ import annotations

import json

__all__ = ["document", "text", "rewritten", "closed", "validator", "place"]


def document(schema) -> dict:
    """The schema as a document: a dict (the schema ``true`` is ``{}``, any JSON value).

    Raises
    ------
    ValueError
        For text that is not JSON, and for the schema ``false``, which no document satisfies.
    TypeError
        For anything but a dict, a bool or a str.
    """
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise ValueError(f"the JSON schema string is not valid JSON: {exc}") from exc
    if schema is True:
        return {}
    if schema is False:
        raise ValueError("the JSON schema false allows no document: nothing can be generated")
    if not isinstance(schema, dict):
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


#: Keywords by which an object schema says itself which members it takes besides ``properties``.
_OPEN = ("additionalProperties", "patternProperties", "unevaluatedProperties")
#: Keywords whose schemas apply to the same object as their siblings.
_APPLICATORS = ("allOf", "anyOf", "oneOf", "$ref")


def closed(schema):
    """The schema with ``additionalProperties: false`` on every object that names its
    ``properties`` and says nothing of other members (a copy). Members it requires without
    naming them are named (any value); one that needs more members than it names
    (``minProperties``) stays open.

    Where schemas merge, objects stay open: an object beside ``allOf``, ``anyOf``,
    ``oneOf`` or ``$ref``, the members of an ``allOf`` (of an ``anyOf`` or ``oneOf`` beside
    ``properties``) and the definitions such members ``$ref``. Each of these names only
    part of the members, and closed, they would refuse one another's.
    """
    # The objects closed here (by id, kept alive so that no id is reused), to reopen.
    ours: dict[int, dict] = {}

    def rewrite(node):
        if _closable(node):
            # A required member the properties do not name is named (as any value), so that
            # closing never empties the language.
            named = node["properties"]
            missing = [n for n in node.get("required", []) if isinstance(n, str) and n not in named]
            node["properties"] = {**named, **{n: {} for n in missing}}
            node["additionalProperties"] = False
            ours[id(node)] = node
        for key, members in _merging(node):
            node[key] = [_reopened(n) if id(n) in ours else n for n in members]
        return node

    out = rewritten(schema, rewrite)
    for ref in _merged_refs(schema):
        for defs in ("$defs", "definitions"):
            name = ref[len(f"#/{defs}/"):]
            if ref.startswith(f"#/{defs}/") and id(out.get(defs, {}).get(name)) in ours:
                out[defs] = {**out[defs], name: _reopened(out[defs][name])}
    return out


def _closable(node: dict) -> bool:
    """An object that names its members and says nothing of others, and can do with those."""
    if not isinstance(node.get("properties"), dict) or any(key in node for key in _OPEN + _APPLICATORS):
        return False
    least = node.get("minProperties", 0)
    names = set(node["properties"]) | set(n for n in node.get("required", []) if isinstance(n, str))
    return not isinstance(least, (int, float)) or least <= len(names)


def _merging(node: dict) -> list[tuple[str, list]]:
    """The lists of schemas in ``node`` that merge with one another or with its properties."""
    keys = ("allOf", "anyOf", "oneOf") if "properties" in node else ("allOf",)
    return [(key, node[key]) for key in keys if isinstance(node.get(key), list)]


def _reopened(node: dict) -> dict:
    return {k: v for k, v in node.items() if k != "additionalProperties"}


def _merged_refs(schema) -> set[str]:
    """The ``$ref`` of every merging member (see :func:`_merging`) that is a reference."""
    refs: set[str] = set()

    def collect(node):
        for _, members in _merging(node):
            refs.update(m["$ref"] for m in members if isinstance(m, dict) and isinstance(m.get("$ref"), str))
        return node

    rewritten(schema, collect)
    return refs


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
