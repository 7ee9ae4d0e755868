import inspect
import json as _json

from outlines_core.json_schema import build_regex_from_schema
from pydantic import BaseModel

from .base import SequenceGenerator, make


def _schema_string(schema) -> tuple[str, object]:
    """The JSON schema as a string, and how to parse a generated document."""
    if isinstance(schema, type) and issubclass(schema, BaseModel):
        return _json.dumps(schema.model_json_schema()), schema.model_validate_json
    if isinstance(schema, dict):
        return _json.dumps(schema), _json.loads
    if isinstance(schema, str):
        try:
            _json.loads(schema)
        except ValueError as exc:
            raise ValueError(f"the JSON schema string is not valid JSON: {exc}") from exc
        return schema, _json.loads
    if callable(schema):
        from outlines.types.utils import get_schema_from_signature

        try:
            inspect.signature(schema)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"cannot read the signature of {schema!r}: {exc}") from exc
        return _json.dumps(get_schema_from_signature(schema)), _json.loads
    raise TypeError("schema must be a pydantic model class, a JSON schema dict or str, or a callable")


_MAX_ENUM = 1000


def _bound_integers(node):
    """Make integer bounds part of the regex, which outlines_core leaves open.

    A bounded integer becomes an ``enum`` of its values when there are at most
    1000 of them; otherwise its digits are bounded (``maxDigits``) so it ends.
    """
    if isinstance(node, list):
        return [_bound_integers(n) for n in node]
    if not isinstance(node, dict):
        return node
    node = {k: _bound_integers(v) for k, v in node.items()}
    if node.get("type") == "integer":
        low = node.get("minimum", node.get("exclusiveMinimum", None))
        high = node.get("maximum", node.get("exclusiveMaximum", None))
        if "exclusiveMinimum" in node and "minimum" not in node:
            low = low + 1 if low is not None else None
        if "exclusiveMaximum" in node and "maximum" not in node:
            high = high - 1 if high is not None else None
        if low is not None and high is not None and 0 <= high - low < _MAX_ENUM:
            keep = {k: v for k, v in node.items() if k in ("title", "description", "default")}
            return {**keep, "enum": list(range(int(low), int(high) + 1))}
        if high is not None and low is not None and "maxDigits" not in node:
            node["maxDigits"] = max(len(str(abs(int(low)))), len(str(abs(int(high)))))
    return node


def json(model, schema, sampler=None, whitespace_pattern=None) -> SequenceGenerator:
    """A JSON document valid against a schema.

    Parameters
    ----------
    schema
        A pydantic model class (``value`` is an instance), a JSON-schema ``dict`` or
        ``str`` (``value`` is the parsed JSON), or a callable whose signature gives the
        schema (``value`` is a dict of arguments). Integer bounds (``minimum``,
        ``maximum``) are enforced by the constraint, unlike outlines'.
    whitespace_pattern
        Regex for the whitespace allowed between JSON tokens (outlines_core's default
        when ``None``).

    Raises
    ------
    ValueError
        When the schema is invalid or unsupported, with the reason.
    """
    schema_str, parse = _schema_string(schema)
    try:
        schema_str = _json.dumps(_bound_integers(_json.loads(schema_str)))
        pattern = build_regex_from_schema(schema_str, whitespace_pattern)
    except Exception as exc:
        raise ValueError(f"cannot build a constraint from this JSON schema: {exc}") from exc
    return make(model, sampler, pattern, parse, kind="json")
