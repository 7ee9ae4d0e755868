"""Values while they stream: each row's value parsed from the text generated so far.

A JSON generator's text so far is read by pydantic_core's partial JSON parser
(``from_json(..., allow_partial="trailing-strings")``): objects and lists hold what is
complete, a string being written shows its prefix, a key without its value yet is left
out. A number being written shows its digits so far; while it ends in ``.``, ``e`` or
a sign it is not a number yet, and its member is left out for that step. For a pydantic
type the data becomes partial objects with ``model_construct``: nothing is validated, a
field not written yet is missing (or holds its default; ``model_fields_set`` names the
written ones), nested models, lists and dicts of models are built the same way.

For every other generator (text, regex, choice, format, grammars) the partial value is
the text generated so far. With a thinking section (``think=``), values are read from the
text after its closing marker only, as ``value`` is: they stay ``None`` (``""`` for text)
while the model thinks. The complete, validated ``value`` comes once the generation ends.
"""

from __future__ import annotations

import collections.abc
import types
import typing
from typing import Any, Callable, Sequence

from pydantic import BaseModel, TypeAdapter
from pydantic_core import from_json

from .think import Answer

__all__ = ["PartialValues", "reader", "construct"]

#: Generator kinds whose text is a JSON document.
JSON_KINDS = ("json", "outlines-json")


def reader(generator) -> Callable[[str, Any], Any]:
    """How to read a row's text so far: ``read(text, previous) -> value so far``.

    ``previous`` is what the row's last text gave; it stays where the text does not parse
    (a stop string after the document, say). With a thinking section, only the text
    after its closing marker is read: the value stays as it began while the model thinks.
    """
    parse, close = generator.parse, None
    if isinstance(parse, Answer):
        parse, close = parse.parse, parse.close
    read = _json_reader(parse) if generator.kind in JSON_KINDS else (lambda text, previous: text)
    if close is None:
        return read

    def answer(text: str, previous: Any) -> Any:
        at = text.find(close)
        return previous if at < 0 else read(text[at + len(close):], previous)

    return answer


def _json_reader(parse) -> Callable[[str, Any], Any]:
    target = _target_type(parse)

    def read(text: str, previous: Any) -> Any:
        try:
            data = from_json(text, allow_partial="trailing-strings")
        except ValueError:  # nothing of the document yet (blank), or text after it that does not parse
            return previous
        return construct(target, data)

    return read


def _target_type(parse) -> Any:
    """The Python type a JSON generator's ``value`` has (``None`` for a JSON schema: plain data)."""
    owner = getattr(parse, "__self__", None)  # a model's model_validate_json, an adapter's validate_json
    if isinstance(owner, type) and issubclass(owner, BaseModel):
        return owner
    if isinstance(owner, TypeAdapter):
        return getattr(owner, "_type", None)
    return None


def construct(target: Any, data: Any) -> Any:
    """``data`` (partial JSON data) as ``target`` without validation: pydantic models through
    ``model_construct`` with the fields present, also inside lists, dicts, ``Optional`` and
    unions of one model; anything else as the data."""
    if isinstance(target, type) and issubclass(target, BaseModel):
        if not isinstance(data, dict):
            return data
        fields = {}
        for name, field in target.model_fields.items():
            key = field.alias if isinstance(field.alias, str) else name
            if key in data:
                fields[name] = construct(field.annotation, data[key])
        return target.model_construct(**fields)
    origin, args = typing.get_origin(target), typing.get_args(target)
    if origin is typing.Annotated:
        return construct(args[0], data)
    if origin in (list, set, frozenset, collections.abc.Sequence) and args and isinstance(data, list):
        return [construct(args[0], item) for item in data]
    if origin is tuple and args and isinstance(data, list):
        items = args if args[-1] is not Ellipsis else (args[0],) * len(data)
        return [construct(t, item) for t, item in zip(items, data)] + data[len(items):]
    if origin is dict and len(args) == 2 and isinstance(data, dict):
        return {k: construct(args[1], v) for k, v in data.items()}
    if origin in (typing.Union, types.UnionType) and isinstance(data, dict):
        models = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
        return construct(models[0], data) if len(models) == 1 else data
    return data


class PartialValues:
    """Turn each step's text pieces into each row's value so far, shaped as ``value``.

    Parameters
    ----------
    generator
        The generator whose values these are.
    shape
        Shapes a list of per-row items as ``value`` is shaped.
    """

    def __init__(self, generator, shape: Callable[[list], Any]):
        self.read, self.shape = reader(generator), shape
        self.empty = "" if generator.kind not in JSON_KINDS else None
        self.texts: list[str] | None = None
        self.values: list[Any] = []

    def __call__(self, pieces: Sequence[str | None]) -> Any:
        if self.texts is None:
            self.texts, self.values = [""] * len(pieces), [self.empty] * len(pieces)
        for r, piece in enumerate(pieces):
            if piece:
                self.texts[r] += piece
                self.values[r] = self.read(self.texts[r], self.values[r])
        return self.shape(list(self.values))
