import inspect
import json as _json

from .. import engines
from ..engines.schema import document, place, rewritten, validator
from .base import SequenceGenerator, make
from .types import schema_of

#: The layouts ``whitespace=`` names, as the regex of what may come between two JSON tokens.
WHITESPACE = {
    "compact": "",
    # A line break and indentation, or one space: a model keeps the layout it writes by
    # itself (pretty-printed or inline), and a weak one cannot write blank space forever.
    "bounded": r"(?:\n[ \t]{0,40}| )?",
    "any": r"[ \t\n\r]*",
}


def json(model, schema, sampler=None, whitespace_pattern=None, *, whitespace=None, engine=None, ban=None,
         ban_case=False, think=None) -> SequenceGenerator:
    """A JSON document valid against a schema.

    Parameters
    ----------
    schema
        A Python type (``value`` is of that type): a pydantic model, a dataclass, a
        ``TypedDict``, ``list[...]``, ``dict[str, ...]``, ``Literal``, an ``Enum``,
        ``Optional`` or a union of these; a JSON schema as ``dict``, ``str`` or
        ``outlines.types.JsonSchema`` (``value`` is the parsed JSON); or a function whose
        signature gives the schema (``value`` is a dict of arguments). What the engine cannot enforce while
        generating is checked on ``value``, which raises ``ValueError`` rather than return
        a document that breaks the schema.
    whitespace
        What may come between two JSON tokens: ``"bounded"`` (the default: a line break
        and indentation, or one space), ``"compact"`` (nothing), ``"any"`` (any JSON
        whitespace, as much as the model writes) or a regex.
    whitespace_pattern
        The same as a regex (give one of the two).
    engine
        ``"llguidance"`` (the default: it reads the schema itself, and refuses a keyword
        it cannot enforce, naming it) or ``"outlines_core"`` (through its regex compiler,
        with exact integer bounds and calendar dates).
    ban, ban_case
        What the document may not contain, as for every generator (:mod:`continuous.ban`).
    think
        A thinking section of free text before the constraint: ``True`` (the model's own
        markers), an int (a token budget) or a :class:`~continuous.Think` (:mod:`continuous.think`).

    Raises
    ------
    ValueError
        When the schema is invalid or unsupported, with the reason.
    """
    if getattr(schema, "whitespace_pattern", None) and whitespace is None and whitespace_pattern is None:
        whitespace_pattern = schema.whitespace_pattern  # an outlines JsonSchema's own
    doc, parse = _document(schema)
    space = _whitespace(whitespace, whitespace_pattern)
    return make(model, sampler, lambda tokenizer: engines.json_schema(doc, tokenizer, engine=engine,
                                                                     whitespace_pattern=space),
                parse, kind="json", ban=ban, ban_case=ban_case, think=think)


def _whitespace(whitespace, pattern) -> str:
    if whitespace is not None and pattern is not None:
        raise ValueError("give whitespace= or whitespace_pattern=, not both")
    if pattern is not None:
        return pattern
    whitespace = "bounded" if whitespace is None else whitespace
    if not isinstance(whitespace, str):
        raise TypeError(f"whitespace must be one of {sorted(WHITESPACE)} or a regex, got {type(whitespace).__name__}")
    return WHITESPACE.get(whitespace, whitespace)


def _document(schema):
    """The JSON schema as a document, and how to parse a generated document."""
    typed = schema_of(schema)
    if typed is not None:
        doc, parse, closed = typed
        # Objects of a Python type take their fields and nothing else, as outlines
        # generates them; JSON Schema itself allows more unless told otherwise.
        doc = _closed(doc) if closed else document(doc)
        return doc, parse or _Validated(doc)
    if isinstance(schema, (dict, str, bool)):
        doc = document(schema)
        return doc, _Validated(doc)
    if callable(schema):
        from outlines.types.utils import get_schema_from_signature

        try:
            inspect.signature(schema)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"cannot read the signature of {schema!r}: {exc}") from exc
        return get_schema_from_signature(schema), _json.loads
    raise TypeError("schema must be a JSON schema (dict, str or outlines.types.JsonSchema), a Python type "
                    "(a pydantic model, a dataclass, list[...], ...) or a function")


def _closed(schema):
    """The schema with ``additionalProperties: false`` on every object that does not say."""
    def rewrite(node):
        if "properties" in node and "additionalProperties" not in node:
            node["additionalProperties"] = False
        return node

    return rewritten(schema, rewrite)


class _Validated:
    """Parse a document and check it against the whole schema.

    An engine cannot enforce every keyword while generating (bounds of non-integers,
    ``multipleOf``, formats it does not know...): a document that breaks one raises rather
    than being returned, naming the keyword.
    """

    def __init__(self, schema):
        self.validator = validator(schema)

    def __call__(self, text: str):
        value = _json.loads(text)
        errors = sorted(self.validator.iter_errors(value), key=lambda e: list(e.path))
        if errors:
            first = errors[0]
            raise ValueError(f"the generated JSON breaks the schema at {place(first.path)} ({first.validator}): "
                             f"{first.message}")
        return value
