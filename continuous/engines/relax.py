"""JSON schemas made ready for an engine: normalized, and relaxed to what its grammar can enforce.

Normalizing keeps the language: whole-number floats in count keywords become integers,
and draft-7 forms (a list of ``items``, ``additionalItems``) become draft 2020-12 ones.

Relaxing widens it: where the engine refuses a schema only over keywords that narrow a
language (``not``, ``if``/``then``/``else``, ``uniqueItems``, ``contains``,
``dependencies``...) or over formats it does not know, they are dropped from the grammar.
The result is a superset of the schema; what was dropped is enforced while decoding
(:mod:`.jsonwatch`) and checked on ``value``.
"""

from __future__ import annotations

import re

from .schema import rewritten

__all__ = ["normalize", "relaxation", "NARROWING", "draft7_hint"]

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


def normalize(schema):
    """The same language in the forms engines read (draft 2020-12, integer counts)."""
    draft7 = isinstance(schema, dict) and bool(_DRAFT7.search(str(schema.get("$schema", ""))))

    def fix(node):
        for key in _COUNTS:
            if isinstance(node.get(key), float) and node[key].is_integer():
                node[key] = int(node[key])
        if isinstance(node.get("items"), list):  # draft 7's tuple form
            node["prefixItems"] = node.pop("items")
            if "additionalItems" in node:
                node["items"] = node.pop("additionalItems")
        elif draft7 and "additionalItems" in node:
            node.pop("additionalItems")  # with a single items schema it has no effect
        for bound, exclusive in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
            if node.get(exclusive) is True and bound in node:  # draft 4: a flag beside the bound
                node[exclusive] = node.pop(bound)
            elif node.get(exclusive) is False:
                node.pop(exclusive)
        return node

    out = rewritten(schema, fix)
    if draft7:
        out.pop("$schema")
    return out


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


def draft7_hint(schema) -> str:
    """A hint for a refused schema that looks like draft 7 but does not say so (else ``""``)."""
    if not isinstance(schema, dict) or "$schema" in schema:
        return ""
    text = str(schema)
    if "'additionalItems'" in text or "'dependencies'" in text:
        return (' (it looks like a draft-7 schema: add "$schema": "http://json-schema.org/draft-07/schema#" '
                "so that it is read as one)")
    return ""
