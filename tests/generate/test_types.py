"""Generators take outlines.types objects and Python types; value comes back as that type."""

import dataclasses
import datetime as dt
import enum
from typing import Annotated, Literal, Optional, Union

import outlines
import outlines.types as ot
import pytest
from pydantic import BaseModel, Field
from support.constraints import accepts
from typing_extensions import TypedDict

from continuous import continuous, generate, samplers

# A random model writes strings and numbers forever: bounded fields let it finish.
Short = Annotated[str, Field(max_length=4)]
Digit = Annotated[int, Field(ge=0, le=9)]


class Item(BaseModel):
    name: Short
    count: Digit


@dataclasses.dataclass
class Point:
    x: Digit
    y: Digit


class Movie(TypedDict):
    title: Short
    year: Annotated[int, Field(ge=1900, le=1999)]


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


def run(gen, prompt="Answer:", **kwargs):
    return continuous(gen)(prompt, max_tokens=120, **kwargs)


@pytest.mark.parametrize("python_type, check", [
    (Annotated[list[Item], Field(max_length=2)], lambda v: isinstance(v, list) and all(isinstance(i, Item) for i in v)),
    (Point, lambda v: isinstance(v, Point) and isinstance(v.x, int)),
    (Movie, lambda v: isinstance(v, dict) and set(v) == {"title", "year"} and isinstance(v["year"], int)),
    (Literal["yes", "no"], lambda v: v in ("yes", "no")),
    (Color, lambda v: isinstance(v, Color)),
    (Optional[Digit], lambda v: v is None or isinstance(v, int)),
    (Union[Digit, bool], lambda v: isinstance(v, (int, bool))),
])
def test_json_values_come_back_as_the_python_type(model, python_type, check):
    gen = generate.json(model, python_type, whitespace="compact",
                        sampler=samplers.multinomial(top_k=20))
    state = run(gen, seed=3)
    assert check(state.value), state.value


def test_json_languages_and_values_of_python_types(model):
    point = generate.json(model, Point, whitespace="compact")
    assert accepts(point, '{"x":1,"y":2}') and not accepts(point, '{"x":1,"y":2,"z":3}')
    assert point.parse('{"x":1,"y":2}') == Point(1, 2)
    counts = generate.json(model, dict[str, int], whitespace="compact")
    assert accepts(counts, '{"a":1,"b":22}') and not accepts(counts, '{"a":"x"}')
    assert counts.parse('{"a":1}') == {"a": 1}
    items = generate.json(model, list[Item], whitespace="compact")
    assert items.parse('[{"name":"ab","count":3}]') == [Item(name="ab", count=3)]
    assert not accepts(items, '[{"name":"ab"}]')


def test_typing_typeddicts_work_on_every_python(model):
    import typing

    class Inner(typing.TypedDict):
        a: Digit

    class Outer(typing.TypedDict, total=False):
        inner: Inner
        items: list[Inner]
        maybe: Optional[Inner]

    gen = generate.json(model, Outer, whitespace="compact")
    assert accepts(gen, '{"inner":{"a":1},"items":[{"a":2}]}') and accepts(gen, "{}")
    assert not accepts(gen, '{"inner":{"a":"x"}}') and not accepts(gen, '{"inner":{}}')
    assert gen.parse('{"inner":{"a":1},"maybe":null}') == {"inner": {"a": 1}, "maybe": None}


def test_choice_takes_literal_enum_and_outlines_choice(model):
    assert run(generate.choice(model, Literal["red", "green"])).value in ("red", "green")
    assert isinstance(run(generate.choice(model, Color)).value, Color)
    assert run(generate.choice(model, ot.Choice(["up", "down"]))).value in ("up", "down")
    assert run(generate.choice(model, Literal[1, 2])).value in (1, 2)


def test_regex_json_and_cfg_take_outlines_terms(model):
    assert run(generate.regex(model, ot.Regex(r"[ab]{4}"))).value in {a + b + c + d for a in "ab" for b in "ab"
                                                                     for c in "ab" for d in "ab"}
    assert run(generate.regex(model, ot.either("cat", "dog"))).value in ("cat", "dog")
    assert int(run(generate.regex(model, ot.integer)).value) is not None
    value = run(generate.json(model, ot.JsonSchema({"type": "object", "properties": {"a": {"type": "integer"}},
                                                    "required": ["a"]}), whitespace="compact")).value
    assert isinstance(value["a"], int)
    assert run(generate.cfg(model, ot.CFG('start: "x" ("y" | "z")'))).value in ("xy", "xz")


@pytest.mark.parametrize("term, kind", [(ot.integer, int), (ot.number, float), (ot.boolean, bool),
                                         (ot.date, dt.date), (ot.time, dt.time)])
def test_format_takes_outlines_built_in_types(model, term, kind):
    assert isinstance(run(generate.format(model, term)).value, kind)


def test_format_gives_the_text_of_other_outlines_terms(model):
    value = run(generate.format(model, ot.hex_color)).value
    assert isinstance(value, str) and value.startswith("#")


def test_what_is_not_a_type_gets_a_clear_error(model):
    with pytest.raises(TypeError, match="choices must be"):
        generate.choice(model, {"a", "b"})
    with pytest.raises(TypeError, match="JSON schema"):
        generate.json(model, 42)
    with pytest.raises(TypeError, match="pattern must be"):
        generate.regex(model, 3)


# ---------------------------------------------------------------- outlines generators
@pytest.fixture(scope="module")
def om(hf_model, tokenizer):
    return outlines.from_transformers(hf_model, tokenizer)


@pytest.mark.parametrize("backend", ["outlines_core", "llguidance"])
def test_outlines_generators_honour_the_call_s_sampler_and_seed(om, backend):
    wrapped = continuous(outlines.Generator(om, ot.Regex(r"[a-z]{6}"), backend=backend))
    greedy = wrapped("Word:").value
    drawn = {wrapped("Word:", seed=s, temperature=2.0).value for s in range(6)}
    assert len(drawn) > 1 and all(len(v) == 6 for v in drawn)
    assert wrapped("Word:", seed=4, temperature=2.0).value == wrapped("Word:", seed=4, temperature=2.0).value
    assert wrapped("Word:").value == greedy


def test_outlines_llguidance_json_is_parsed_and_typed(om):
    gen = outlines.Generator(om, Item, backend="llguidance")
    assert isinstance(continuous(gen)("Item:", max_tokens=200, seed=1, top_k=20).value, dict)
    typed = continuous(gen, output_type=Item)("Item:", max_tokens=200, seed=1, top_k=20).value
    assert isinstance(typed, Item)


def test_outlines_core_values_take_the_output_type_given(om):
    gen = outlines.Generator(om, int)
    assert isinstance(continuous(gen, output_type=int)("Number:", max_tokens=8).value, int)
    with pytest.raises(ValueError, match="output_type"):
        continuous(generate.text(om and continuous(gen).model), output_type=int)


def test_output_types_are_read_as_generate_json_reads_them():
    import typing

    from continuous.generate.types import parser_of

    class Old(typing.TypedDict):
        a: int

    assert parser_of(Old)('{"a": 1}') == {"a": 1}
    assert parser_of(int)("12") == 12 and parser_of(dt.date)("2024-02-29") == dt.date(2024, 2, 29)
    with pytest.raises(ValueError):
        parser_of(Old)('{"a": "x"}')


def test_outlines_core_json_is_parsed_and_regex_text_kept(om):
    value = continuous(outlines.Generator(om, Item))("Item:", max_tokens=200, seed=1, top_k=20).value
    # (outlines_core's own compiler leaves out integer bounds: the keys are what is sure)
    assert isinstance(value, dict) and set(value) == {"name", "count"}
    digits = continuous(outlines.Generator(om, ot.Regex(r"[0-9]{3}")))("Number:").value
    assert isinstance(digits, str) and len(digits) == 3
