"""What the generators take besides their own forms: ``outlines.types`` objects and Python types.

Each function reads one kind of argument and returns what the generator builds from
(``None`` where the argument is not of that kind), so that every generator accepts
the same objects outlines does, where the kind makes sense.
"""

from __future__ import annotations

import enum
import json
import sys
import types
import typing
from typing import Any, Callable

import typing_extensions
from outlines.types.dsl import CFG, Choice, JsonSchema, Term, to_regex
from pydantic import (
    BaseModel,
    PydanticSchemaGenerationError,
    PydanticUserError,
    TypeAdapter,
    ValidationError,
)
from typing_extensions import NotRequired, Required

__all__ = ["pattern_of", "grammar_of", "choices_of", "schema_of", "parser_of", "json_or_text"]


def pattern_of(spec) -> str | None:
    """The regex of an ``outlines.types`` term (``Regex``, ``integer``, ``either(...)``...)."""
    if isinstance(spec, (CFG, JsonSchema)) or not isinstance(spec, Term):
        return None
    return to_regex(spec)


def grammar_of(spec) -> str | None:
    """The Lark grammar of an ``outlines.types.CFG``."""
    return spec.definition if isinstance(spec, CFG) else None


def choices_of(spec) -> dict[str, Any] | None:
    """Text -> value of each choice of an ``outlines.types.Choice``, a ``Literal`` or an ``Enum``."""
    if isinstance(spec, Choice):
        items = list(spec.items)
    elif typing.get_origin(spec) is typing.Literal:
        items = list(typing.get_args(spec))
    elif isinstance(spec, type) and issubclass(spec, enum.Enum):
        return {str(m.value): m for m in spec}
    else:
        return None
    return {str(item): item for item in items}


def schema_of(spec) -> tuple[Any, Callable[[str], Any] | None] | None:
    """The JSON schema of an ``outlines.types.JsonSchema`` or a Python type, and how to parse
    a document into the type (``None``: as JSON).

    Python types are what pydantic reads: models, dataclasses, ``TypedDict``, ``list[...]``,
    ``dict[str, ...]``, ``Literal``, ``Enum``, ``Optional`` and unions.
    """
    if isinstance(spec, JsonSchema):
        return json.loads(spec.schema), None
    if not _is_type(spec):
        return None
    try:
        adapter = TypeAdapter(_readable(spec))
        schema = adapter.json_schema()
    except (PydanticSchemaGenerationError, PydanticUserError) as exc:
        raise TypeError(f"{spec!r} has no JSON schema: {exc}") from None
    if isinstance(spec, type) and issubclass(spec, BaseModel):
        return schema, spec.model_validate_json
    return schema, adapter.validate_json


def parser_of(python_type) -> Callable[[str], Any]:
    """Parse text into ``python_type``: as JSON, else as pydantic reads it from a string."""
    adapter = TypeAdapter(_readable(python_type))

    def parse(text: str):
        try:
            return adapter.validate_json(text)
        except ValidationError:
            return adapter.validate_strings(text)

    return parse


def json_or_text(text: str) -> Any:
    """The value of an outlines generator on outlines_core: the parsed JSON of a JSON object
    or array, else the text.

    Its ``Index`` does not say whether a JSON schema or a regex made it; the schemas of
    outlines' output types are objects and arrays, and a regex's text is kept as it is.
    """
    if text.lstrip()[:1] in ("{", "["):
        try:
            return json.loads(text)
        except ValueError:
            pass
    return text


def _readable(spec):
    """``spec`` with each ``typing.TypedDict`` made a ``typing_extensions`` one: pydantic reads
    only those before Python 3.12."""
    if sys.version_info >= (3, 12):
        return spec
    if typing.is_typeddict(spec) and type(spec).__module__ == "typing":
        required = spec.__required_keys__
        fields = {k: (Required if k in required else NotRequired)[_readable(v)]
                  for k, v in typing.get_type_hints(spec, include_extras=True).items()}
        return typing_extensions.TypedDict(spec.__name__, fields)
    origin, args = typing.get_origin(spec), typing.get_args(spec)
    if origin is None or origin is typing.Literal or not args:
        return spec
    if origin is typing.Annotated:
        return typing.Annotated[(_readable(args[0]), *args[1:])]
    new = tuple(_readable(a) for a in args)
    if new == args:
        return spec
    return spec.copy_with(new) if hasattr(spec, "copy_with") else types.GenericAlias(origin, new)


def _is_type(spec) -> bool:
    """A class or a typing form (``list[int]``, ``Optional[X]``, ``Literal[...]``), not a function."""
    return isinstance(spec, type) or typing.get_origin(spec) is not None
