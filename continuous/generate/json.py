import inspect
import json as _json

import interegular

from .. import engines
from ..engines.relax import normalize
from ..engines.schema import closed, document, place, validator
from .base import SequenceGenerator, check_model, make
from .types import schema_of

#: The layouts ``whitespace=`` names, as the regex of what may come between two JSON tokens.
WHITESPACE = {
    "compact": "",
    # A line break and indentation, or one space: a model keeps the layout it writes by
    # itself (pretty-printed or inline), and a weak one cannot write blank space forever.
    "bounded": r"(?:\n[ \t]{0,40}| )?",
    "any": r"[ \t\n\r]*",
}


def json(model, schema, sampler=None, whitespace_pattern=None, *, whitespace=None, extra_properties=False,
         engine=None, ban=None, ban_case=False, think=None) -> SequenceGenerator:
    """A JSON document valid against a schema.

    Parameters
    ----------
    schema
        A Python type (``value`` is of that type): a pydantic model, a dataclass, a
        ``TypedDict``, ``list[...]``, ``dict[str, ...]``, ``Literal``, an ``Enum``,
        ``Optional`` or a union of these; a JSON schema as ``dict``, ``bool``, ``str`` or
        ``outlines.types.JsonSchema`` (``value`` is the parsed JSON); or a function whose
        signature gives the schema (``value`` is a dict of its arguments, and no other
        key). What the engine cannot enforce while generating is checked on ``value``,
        which raises ``ValueError`` rather than return a document that breaks the schema.
    whitespace
        What may come between two JSON tokens: ``"bounded"`` (the default: a line break
        and indentation, or one space), ``"compact"`` (nothing), ``"any"`` (any JSON
        whitespace, as much as the model writes) or a regex that matches nothing but
        JSON whitespace (spaces, tabs, line feeds, carriage returns).
    whitespace_pattern
        The same as a regex (give one of the two).
    extra_properties
        Whether objects may have members their schema does not name where it says nothing
        of other members (no ``additionalProperties``, ``patternProperties`` or
        ``unevaluatedProperties``). ``False`` (the default) generates only the named
        members, as outlines does; ``True`` generates what JSON Schema allows. Either way
        ``value`` is checked against the schema as given. A function's arguments are
        always only its own.
    engine
        ``"llguidance"`` (the default: it reads the schema itself, and refuses a keyword
        it cannot enforce, naming it) or ``"outlines_core"`` (through its regex compiler,
        with exact integer bounds and calendar dates).
    ban, ban_case, think
        As for every generator (:func:`~continuous.generate.text`).

    Raises
    ------
    ValueError
        When the schema is invalid or unsupported, with the reason.
    """
    check_model(model)  # before model.tokenizer is read
    if getattr(schema, "whitespace_pattern", None) and whitespace is None and whitespace_pattern is None:
        whitespace_pattern = schema.whitespace_pattern  # an outlines JsonSchema's own
    doc, parse = _document(schema, extra_properties)
    space = _whitespace(whitespace, whitespace_pattern)
    return make(model, sampler, lambda tokenizer: engines.json_schema(doc, tokenizer, engine=engine,
                                                                     whitespace_pattern=space),
                parse, kind="json", ban=ban, ban_case=ban_case, think=think)


def _whitespace(whitespace, pattern) -> str:
    if whitespace is not None and pattern is not None:
        raise ValueError("give whitespace= or whitespace_pattern=, not both")
    if pattern is None:
        whitespace = "bounded" if whitespace is None else whitespace
        if not isinstance(whitespace, str):
            raise TypeError(f"whitespace must be one of {sorted(WHITESPACE)} or a regex, "
                            f"got {type(whitespace).__name__}")
        pattern = WHITESPACE.get(whitespace, whitespace)
    _check_whitespace(pattern, "whitespace" if whitespace is not None else "whitespace_pattern")
    return pattern


#: The language every whitespace pattern must stay within: JSON's whitespace.
_JSON_WHITESPACE = interegular.parse_pattern(r"[ \t\n\r]*").to_fsm()


def _check_whitespace(pattern, name: str) -> None:
    """Refuse a pattern that can match more than JSON whitespace (a typo such as ``"Compact"``)."""
    if not isinstance(pattern, str):
        raise TypeError(f"{name} must be a str, got {type(pattern).__name__}")
    try:
        fsm = interegular.parse_pattern(pattern).to_fsm(_JSON_WHITESPACE.alphabet)
        wider = not fsm.difference(_JSON_WHITESPACE).empty()
    except Exception as exc:  # a syntax interegular does not read
        raise ValueError(f"{name}={pattern!r} cannot be read as a regex of JSON whitespace: {exc}") from None
    if wider:
        raise ValueError(f"{name}={pattern!r} can match more than JSON whitespace (spaces, tabs, line feeds, "
                         f"carriage returns): give one of {sorted(WHITESPACE)} or a regex such as "
                         "'[ \\t\\n\\r]*'")


def _document(schema, extra_properties: bool):
    """The JSON schema to generate from, and how to parse a generated document.

    Objects take only the members they name unless ``extra_properties`` (the parser
    checks the schema as given either way).
    """
    typed = schema_of(schema)
    if typed is not None:
        doc, parse = typed
        doc = document(doc)
    elif isinstance(schema, (dict, str, bool)):
        doc, parse = document(schema), None
    elif callable(schema):
        # A function takes its own arguments only (outlines reads no **kwargs), so its
        # schema is closed whatever extra_properties says, and value is checked so.
        doc, parse = closed(_signature(schema)), None
    else:
        raise TypeError("schema must be a JSON schema (dict, bool, str or outlines.types.JsonSchema), a Python "
                        "type (a pydantic model, a dataclass, list[...], ...) or a function")
    # Checked normalized: a draft-7 schema is read as draft 7 whether it says so or not.
    return (doc if extra_properties else closed(doc)), parse or _Validated(normalize(doc))


def _signature(function) -> dict:
    from outlines.types.utils import get_schema_from_signature

    try:
        inspect.signature(function)
        return get_schema_from_signature(function)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"cannot read the signature of {function!r}: {exc}") from exc


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
