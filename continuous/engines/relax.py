"""JSON schemas made ready for an engine: normalized, and relaxed to what its grammar can enforce.

Normalizing keeps the language: whole-number floats in count keywords become integers,
and draft-7 forms (a list of ``items``, ``additionalItems``, ``dependencies``) become draft
2020-12 ones. A schema is read as draft 7 when its ``$schema`` says so, or when it says no
``$schema`` and uses a form only draft 7 has.

Relaxing widens it: where the engine refuses a schema only over keywords that narrow a
language (``not``, ``if``/``then``/``else``, ``uniqueItems``, ``contains``,
``dependencies``...) or over formats it does not know, they are dropped from the grammar.
The result is a superset of the schema; what was dropped is enforced while decoding
(:mod:`.jsonwatch`) and checked on ``value``.
"""

from __future__ import annotations

import re

from .schema import rewritten

__all__ = ["normalize", "relaxation", "NARROWING", "draft7"]

_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties",
           "minContains", "maxContains")

#: Keywords whose removal from a schema only widens its language.
NARROWING = frozenset({"not", "if", "then", "else", "uniqueItems", "contains", "minContains", "maxContains",
                       "dependencies", "dependentRequired", "dependentSchemas", "propertyNames",
                       "unevaluatedProperties", "unevaluatedItems", "minProperties", "maxProperties", "oneOf"})

_DRAFT7 = re.compile(r"draft-0[467]")

#: Other refusals, and the keywords whose removal answers them while only widening the
#: language: patterned properties that overlap (with any other property allowed instead),
#: intersections too deep for the engine, counts of properties it cannot bound.
_WIDENING = (("min/maxProperties only supported", frozenset({"minProperties", "maxProperties"})),
             ("are not disjoint", frozenset({"patternProperties", "additionalProperties"})),
             ("Schema intersection stack level exceeded", frozenset({"allOf"})))


def draft7(schema) -> bool:
    """Whether a schema is read as draft 7 (or 4 or 6): its ``$schema`` says so, or it says no
    ``$schema`` and uses a form of those drafts (``items`` as a list, ``additionalItems``,
    ``dependencies``), which draft 2020-12 does not have."""
    if not isinstance(schema, dict):
        return False
    if "$schema" in schema:
        return bool(_DRAFT7.search(str(schema["$schema"])))
    found = []

    def look(node):
        if isinstance(node.get("items"), list) or "additionalItems" in node or "dependencies" in node:
            found.append(node)
        return node

    rewritten(schema, look)
    return bool(found)


def normalize(schema):
    """The same language in the forms engines and validators read (draft 2020-12, integer counts)."""
    old = draft7(schema)

    def fix(node):
        for key in _COUNTS:
            if isinstance(node.get(key), float) and node[key].is_integer():
                node[key] = int(node[key])
        if isinstance(node.get("items"), list):  # draft 7's tuple form
            node["prefixItems"] = node.pop("items")
            if "additionalItems" in node:
                node["items"] = node.pop("additionalItems")
        elif old and "additionalItems" in node:
            node.pop("additionalItems")  # with a single items schema it has no effect
        if old and isinstance(node.get("dependencies"), dict):
            _split_dependencies(node)
        for bound, exclusive in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
            if node.get(exclusive) is True and bound in node:  # draft 4: a flag beside the bound
                node[exclusive] = node.pop(bound)
            elif node.get(exclusive) is False:
                node.pop(exclusive)
        return node

    out = rewritten(schema, fix)
    if old:
        out.pop("$schema", None)
    return out


def _split_dependencies(node: dict) -> None:
    """Draft 7's ``dependencies`` as draft 2020-12's ``dependentRequired`` (lists of names)
    and ``dependentSchemas`` (schemas)."""
    for name, then in node.pop("dependencies").items():
        key = "dependentRequired" if isinstance(then, list) else "dependentSchemas"
        node[key] = {**node.get(key, {}), name: then}


def relaxation(schema, reason: str) -> tuple[object, set[str], dict] | None:
    """The schema without what the engine's refusal ``reason`` names, if that only widens it.

    Returns
    -------
    (schema, dropped, options) or None
        The relaxed schema, the keywords dropped from it (enforced elsewhere), and engine
        options to add; ``None`` when the refusal is over something else.
    """
    keys = re.search(r'Unimplemented keys: \[([^\]]*)\]', reason)
    if keys:
        names = set(re.findall(r'"([^"]+)"', keys.group(1)))
        if names <= NARROWING:
            return _without(schema, names), names, {}
        return None
    if "oneOf constraints are not supported" in reason:
        return schema, {"oneOf"}, {"coerce_one_of": True}
    for words, names in _WIDENING:
        if words in reason:
            return _without(schema, names), set(names), {}
    unknown = re.search(r"Unknown format: (\S+)", reason)
    if unknown:
        name = unknown.group(1)
        # An annotation the grammar cannot check: kept for the validation of value.
        return rewritten(schema, lambda n: _drop_format(n, name)), {"format"}, {}
    return None


def _without(schema, names: set[str]):
    return rewritten(schema, lambda node: {k: v for k, v in node.items() if k not in names})


def _drop_format(node: dict, name: str) -> dict:
    if node.get("format") == name:
        node = {k: v for k, v in node.items() if k != "format"}
    return node
