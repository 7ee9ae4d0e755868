"""generate.*: constraints hold, values parse, weights are the masked log-probabilities."""

import datetime as dt
import enum
import json
import re
from typing import Literal, Optional

import pytest
import torch
from pydantic import BaseModel, Field
from support.constraints import accepts

from continuous import continuous, engines, generate, samplers
from continuous.engines import outlines_core
from continuous.generate.format import _FORMATS

WS = ""  # no free whitespace: a random model would otherwise wander in it


class Pet(str, enum.Enum):
    cat = "cat"
    dog = "dog"


class Address(BaseModel):
    city: Literal["Paris", "Lima", "Oslo"]
    zip: int = Field(ge=0, le=99)


class Person(BaseModel):
    name: str = Field(max_length=6)
    age: int = Field(ge=0, le=99)
    pet: Pet
    address: Address
    tags: list[Literal["a", "b"]] = Field(max_length=2)
    nickname: Optional[Literal["Al", "Bo"]] = None




@pytest.mark.parametrize("sampler", [None, samplers.multinomial(2), samplers.beam_search(2)],
                         ids=["greedy", "multinomial", "beam"])
def test_json_outputs_parse(model, sampler):
    gen = continuous(generate.json(model, Person, sampler, whitespace_pattern=WS))
    state = gen(["Describe a person:\n", "Another one:"], max_tokens=150, seed=3)
    values = state.value
    flat = [v for row in values for v in row] if isinstance(values[0], list) else values
    for v in flat:
        assert isinstance(v, Person)
    for r, text in enumerate(state._values):
        Person.model_validate_json(text)
        assert list(state)[r].endswith(text)


def test_json_dict_string_and_callable_schemas(model):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                                "n": {"enum": [1, 2, 3]}}, "required": ["ok", "n"]}
    for s in (schema, json.dumps(schema)):
        value = continuous(generate.json(model, s, whitespace_pattern=WS))("JSON:", max_tokens=40).value
        assert isinstance(value, dict) and set(value) == {"ok", "n"} and value["n"] in (1, 2, 3)

    def f(flag: bool, kind: Literal["x", "y"]):
        return flag, kind

    value = continuous(generate.json(model, f, whitespace_pattern=WS))("Call:", max_tokens=40).value
    assert set(value) == {"flag", "kind"} and value["kind"] in ("x", "y")


def test_json_objects_take_only_their_named_members_unless_told(model):
    from outlines.types import JsonSchema

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}

    class A(BaseModel):
        a: int

    extra = '{"a":1,"b":2}'
    for s in (schema, json.dumps(schema), JsonSchema(json.dumps(schema)), A):
        assert accepts(generate.json(model, s, whitespace="compact"), '{"a":1}')
        assert not accepts(generate.json(model, s, whitespace="compact"), extra)
    for s in (schema, json.dumps(schema), JsonSchema(json.dumps(schema))):
        assert accepts(generate.json(model, s, whitespace="compact", extra_properties=True), extra)
    # What the schema says itself holds: its own additionalProperties, patternProperties.
    for more in ({"additionalProperties": True}, {"additionalProperties": {"type": "integer"}},
                 {"patternProperties": {"^b": {"type": "integer"}}}):
        assert accepts(generate.json(model, {**schema, **more}, whitespace="compact"), extra)
    # Closing never empties a language: a required member not named is named, and an
    # object that needs more members than it names stays open.
    required = generate.json(model, {**schema, "required": ["a", "b"]}, whitespace="compact")
    assert accepts(required, extra) and not accepts(required, '{"a":1,"b":2,"c":3}')
    assert accepts(generate.json(model, {**schema, "minProperties": 2}, whitespace="compact"), extra)
    # Objects that merge stay open: closed, each would refuse the other's members.
    merged = {"allOf": [{"properties": {"a": {"type": "integer"}}}, {"$ref": "#/$defs/B"}],
              "$defs": {"B": {"properties": {"b": {"type": "integer"}}}}, "required": ["a", "b"]}
    assert accepts(generate.json(model, merged, whitespace="compact"), extra)


def test_json_of_the_schema_true_is_any_document_and_false_is_refused(model):
    for schema in (True, "true", {}):
        gen = generate.json(model, schema, whitespace="compact")
        assert accepts(gen, '[1,"x",{"k":null}]') and gen.parse('{"k":2}') == {"k": 2}
    with pytest.raises(ValueError, match="allows no document"):
        generate.json(model, False)


def test_json_of_a_function_takes_only_its_arguments_and_checks_them(model):
    def f(flag: bool, n: int = 3):
        return flag, n

    gen = generate.json(model, f, whitespace="compact")
    assert accepts(gen, '{"flag":true,"n":2}') and accepts(gen, '{"flag":true}')
    assert not accepts(gen, '{"flag":true,"other":1}')
    assert gen.parse('{"flag":false}') == {"flag": False}
    with pytest.raises(ValueError, match="required"):
        gen.parse('{"n":2}')
    with pytest.raises(ValueError, match="additionalProperties"):
        generate.json(model, f, extra_properties=True).parse('{"flag":true,"other":1}')


@pytest.mark.parametrize("name", ["whitespace", "whitespace_pattern"])
@pytest.mark.parametrize("pattern", ["Compact", r"\s*", ".?", "[^a]*", " |x", r"\p{Zs}"])
def test_a_whitespace_pattern_wider_than_json_whitespace_is_refused(model, name, pattern):
    with pytest.raises(ValueError, match="JSON whitespace"):
        generate.json(model, {"type": "integer"}, **{name: pattern})


def test_whitespace_patterns_within_json_whitespace_are_taken(model):
    for kind in ("compact", "bounded", "any"):
        generate.json(model, {"type": "integer"}, whitespace=kind)
    for pattern in ("", " ?", r"[ \t\n\r]*", r"(?:\n[ \t]{0,4}| )?"):
        generate.json(model, {"type": "integer"}, whitespace_pattern=pattern)


def test_choice(model):
    gen = continuous(generate.choice(model, ["Paris", "Lima", "a longer choice"], samplers.multinomial(3)))
    state = gen(["City:", "Where?"], seed=0)
    assert all(v in ("Paris", "Lima", "a longer choice") for row in state.value for v in row)
    assert continuous(generate.choice(model, Pet))("Pet:").value in (Pet.cat, Pet.dog)


@pytest.mark.parametrize("pattern", [r"[0-9]{3}-[a-z]{2}", r"(yes|no)!", r"\d{1,4}\.\d\d"])
def test_regex(model, pattern):
    state = continuous(generate.regex(model, pattern, samplers.multinomial(3)))("Code:", max_tokens=30, seed=1)
    for v in state.value:
        assert re.fullmatch(pattern, v), v


@pytest.mark.parametrize("ptype", [int, float, bool, str, dt.date, dt.time, dt.datetime])
def test_format(model, ptype):
    gen = generate.format(model, ptype, samplers.multinomial(2))
    state = continuous(gen)("Value:", max_tokens=40, seed=2)
    pattern = _FORMATS[ptype][0]
    if all(re.fullmatch(pattern, t) for t in state._values):
        for v in state.value:
            assert isinstance(v, ptype)
    else:  # a random model may not close a string within max_tokens
        assert ptype is str
        with pytest.raises(ValueError, match="cut short"):
            state.value


def test_invalid_constraints_fail_when_built(model):
    with pytest.raises(ValueError, match="regex"):
        generate.regex(model, r"(unclosed")
    with pytest.raises(ValueError, match="JSON"):
        generate.json(model, "{not json")
    with pytest.raises(ValueError, match="JSON schema"):
        generate.json(model, {"type": "object", "properties": {"x": {"$ref": "#/nowhere"}}})
    with pytest.raises(TypeError):
        generate.json(model, 42)
    with pytest.raises(ValueError):
        generate.format(model, list)
    with pytest.raises(TypeError):
        generate.choice(model, "abc")
    with pytest.raises(TypeError):
        generate.text(model, sampler="greedy")


def test_constraints_are_built_once_per_pattern_and_vocabulary(model):
    a = generate.regex(model, r"[a-c]{2,4}", engine="outlines_core")
    b = generate.regex(model, r"[a-c]{2,4}", engine="outlines_core")
    assert a.constraint is b.constraint and a.engine == "outlines_core"
    assert outlines_core.regex(r"[a-c]{2,4}", model.tokenizer) is a.constraint
    c = generate.regex(model, r"[a-c]{2,4}")  # the default engine, llguidance
    assert c.engine == "llguidance" and c.constraint is not a.constraint
    assert generate.regex(model, r"[a-c]{2,4}").constraint is c.constraint


@pytest.mark.parametrize("sampler", [samplers.greedy(), samplers.multinomial(1, temperature=0.7, top_k=20)],
                         ids=["greedy", "multinomial"])
def test_weights_are_masked_log_probabilities(model, hf_model, sampler):
    """Recompute every step from scratch: weight = sum of log_softmax(masked, processed logits)."""
    gen_obj = generate.regex(model, r"[a-z ]{3,12}\.", sampler)
    prompt = "Alice lives in"
    state = continuous(gen_obj)(prompt, max_tokens=14, seed=5)
    prompt_ids = model.tokenizer(prompt).input_ids
    ids = state._rows.real_ids(0)
    generated = ids[len(prompt_ids):]
    matcher = gen_obj.constraint.matcher()
    words = torch.zeros((model.vocab_size + 31) // 32, dtype=torch.int32)
    total = 0.0
    for i, token in enumerate(generated):
        with torch.no_grad():
            logits = hf_model(torch.tensor([ids[: len(prompt_ids) + i]])).logits[0, -1].float()
        matcher.fill(words)
        bits = (words.long().unsqueeze(-1) >> torch.arange(32)) & 1
        allowed = bits.view(-1)[: logits.shape[0]].bool()
        masked = logits.masked_fill(~allowed, -torch.inf)
        if hasattr(sampler, "process"):
            masked = sampler.process(masked[None])[0]
        if allowed.sum() > 1:  # a token the constraint forces is not sampled: log-probability 0
            total += torch.log_softmax(masked, -1)[token].item()
        matcher.advance(token)
    assert state.weights.shape == (1, 1)
    assert state.weights.item() == pytest.approx(total, abs=1e-3)


def test_weights_accumulate_across_generator_kinds(model):
    choice = continuous(generate.choice(model, ["yes", "no"]))
    text = continuous(generate.text(model))
    a = choice("Q?")
    b = text(a + " because", max_tokens=3)
    c = continuous(generate.format(model, int))(b + " n=", max_tokens=3)
    assert b.weights.item() < a.weights.item() <= 0
    assert c.weights.item() < b.weights.item()


def test_beam_search_under_a_constraint_with_few_allowed_tokens(model):
    """More beams than allowed tokens: the extra beams end with a -inf weight instead of crashing."""
    gen = continuous(generate.json(model, Address, samplers.beam_search(4), whitespace_pattern=WS))
    state = gen(["Where?", "Address:"], max_tokens=40)
    for b in range(2):
        for s in range(4):
            value = state.value[b][s]
            assert (value is None) == bool(torch.isinf(state.weights[b, s]))
            assert value is None or isinstance(value, Address)
    assert torch.isfinite(state.weights[:, 0]).all()
    choice = continuous(generate.choice(model, ["yes", "no"], samplers.beam_search(3)))("Q?")
    assert set(choice.value) <= {"yes", "no", None} and choice.value[0] in ("yes", "no")


# ---------------------------------------------------------------- numbers and bounds
CUT_SHORT = [
    ("choice", lambda m: generate.choice(m, ["alphabetically", "betamaxes"]), 1),
    ("regex", lambda m: generate.regex(m, r"[a-z]{12}"), 2),
    ("format bool", lambda m: generate.format(m, bool), 1),
    ("format date", lambda m: generate.format(m, dt.date), 2),
    ("json", lambda m: generate.json(m, Person, whitespace_pattern=WS), 3),
]


@pytest.mark.parametrize("name, build, max_tokens", CUT_SHORT, ids=[c[0] for c in CUT_SHORT])
def test_value_of_a_constraint_cut_short_raises(model, name, build, max_tokens):
    gen = build(model)
    state = continuous(gen)("Answer:", max_tokens=max_tokens)
    generated = state._values[0]
    assert not accepts(gen, generated)  # the call was indeed cut short
    with pytest.raises(ValueError, match="cut short|does not parse"):
        state.value
    # The state stays usable: it prints, and it continues.
    assert str(state).endswith(generated)
    more = continuous(generate.text(model))(state, max_tokens=2)
    assert str(more).startswith(str(state))


def test_value_of_a_complete_match_parses(model):
    state = continuous(generate.choice(model, ["alphabetically", "betamaxes"]))("Answer:")
    assert state.value in ("alphabetically", "betamaxes")


# ---------------------------------------------------------------- bad arguments
def test_bad_generator_arguments_fail_when_built(model):
    with pytest.raises(TypeError, match="continuous.models"):
        generate.text("path/to/model")
    with pytest.raises(TypeError, match="continuous.models"):
        generate.choice("gpt2", ["a", "b"])
    with pytest.raises(TypeError, match="continuous.models"):
        generate.json("some/model", {"type": "integer"})
    with pytest.raises(TypeError, match="list"):
        generate.choice(model, (c for c in ["a", "b"]))
    with pytest.raises(TypeError, match="list"):
        generate.choice(model, {"a", "b"})

    class Empty(enum.Enum):
        pass

    with pytest.raises(ValueError, match="at least one"):
        generate.choice(model, Empty)
    with pytest.raises(ValueError, match="at least one"):
        generate.choice(model, [])
    for pattern in (r"^[a-z]+$", r"^abc", r"abc$", r"(a|^b)", r"\Aab\Z"):
        with pytest.raises(ValueError, match="anchors"):
            generate.regex(model, pattern)
    # An escaped dollar is text, not an anchor.
    assert accepts(generate.regex(model, r"\$[0-9]{2}"), "$12")


# ---------------------------------------------------------------- exact integer ranges and dates
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from continuous.engines.formats import DATE  # noqa: E402
from continuous.engines.schema_regex import integer_range  # noqa: E402

bounds = st.one_of(st.none(), st.integers(-10**12, 10**12))


@settings(max_examples=300, deadline=None)
@given(low=bounds, high=bounds, probes=st.lists(st.integers(-10**13, 10**13), max_size=20))
def test_integer_range_regex_is_exact(low, high, probes):
    if low is not None and high is not None and low > high:
        low, high = high, low
    pattern = re.compile(integer_range(low, high))
    near = [b + d for b in (low, high, 0) if b is not None for d in (-1, 0, 1)]
    for n in probes + near:
        inside = (low is None or n >= low) and (high is None or n <= high)
        assert bool(pattern.fullmatch(str(n))) == inside, (low, high, n)
    assert not pattern.fullmatch("-0") and not pattern.fullmatch("007")


def _doc_matches(gen, value):
    return accepts(gen, json.dumps({"n": value}, separators=(",", ":")))


ENGINES = ["llguidance", "outlines_core"]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("node, inside, outside", [
    ({"minimum": 100, "maximum": 100000}, [100, 5000, 100000], [794444, -5, 99, 100001, 0]),
    ({"minimum": 10}, [10, 11, 10**15], [9, 0, -10]),
    ({"maximum": -3}, [-3, -10**12], [-2, 0, 5]),
    ({"minimum": 1.5}, [2, 3], [1, 0, -2]),
    ({"exclusiveMinimum": 2, "exclusiveMaximum": 5}, [3, 4], [2, 5]),
    ({"exclusiveMaximum": 2.5}, [2, -7], [3]),
    ({"minimum": 3, "exclusiveMinimum": True, "maximum": 7, "exclusiveMaximum": True}, [4, 6], [3, 7]),
    ({"minimum": -20, "maximum": -10}, [-20, -15, -10], [-21, -9, 0, 15]),
])
def test_json_integer_bounds_are_exact_in_the_constraint(model, node, inside, outside, engine):
    schema = {"type": "object", "properties": {"n": {"type": "integer", **node}}, "required": ["n"],
              "additionalProperties": False}
    if any(isinstance(v, bool) for v in node.values()):  # boolean exclusive bounds are draft 4's
        schema["$schema"] = "http://json-schema.org/draft-04/schema#"
    gen = generate.json(model, schema, whitespace_pattern=WS, engine=engine)
    assert all(_doc_matches(gen, v) for v in inside)
    assert not any(_doc_matches(gen, v) for v in outside)


@pytest.mark.parametrize("engine", ENGINES)
def test_pydantic_integer_bounds_are_exact_in_the_constraint(model, engine):
    class Big(BaseModel):
        n: int = Field(ge=100, le=100000)

    gen = generate.json(model, Big, whitespace_pattern=WS, engine=engine)
    assert _doc_matches(gen, 100000) and not _doc_matches(gen, 794444) and not _doc_matches(gen, -5)


@pytest.mark.parametrize("engine", ENGINES)
def test_json_value_is_validated_where_the_constraint_cannot_say_it(model, engine):
    schema = {"type": "object", "properties": {"x": {"type": "number", "minimum": 1.5},
                                                "k": {"type": "integer", "multipleOf": 3}},
              "required": ["x", "k"], "additionalProperties": False}
    gen = generate.json(model, schema, whitespace_pattern=WS, engine=engine)
    assert gen.parse('{"x":2.5,"k":9}') == {"x": 2.5, "k": 9}
    for bad in ('{"x":1.0,"k":9}', '{"x":2,"k":4}'):
        # Never silently invalid: the constraint refuses it, or the value raises.
        if accepts(gen, bad):
            with pytest.raises(ValueError, match="breaks the schema"):
                gen.parse(bad)
    if engine == "outlines_core":  # its regex cannot say these: the value is the guard
        assert accepts(gen, '{"x":1.0,"k":9}') and accepts(gen, '{"x":2,"k":4}')


@pytest.mark.parametrize("build, reason", [
    (lambda m: generate.choice(m, ["cat", "category"], engine="outlines_core"), "go on after a complete one"),
    (lambda m: generate.regex(m, r"[0-9]+(\.[0-9]+)?", engine="outlines_core"), "go on after a complete one"),
    (lambda m: generate.json(m, {"type": "number"}, engine="outlines_core"), "go on after a complete one"),
    (lambda m: generate.json(m, {"type": "object", "properties": {"a": {"type": "integer"}}},
                             extra_properties=True, engine="outlines_core"), "beyond those listed"),
    (lambda m: generate.json(m, {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                                 "additionalProperties": False, "allOf": [{"required": ["a"]}]},
                             engine="outlines_core"), "allOf"),
    (lambda m: generate.json(m, {"const": {"a.b": 1}}, engine="outlines_core"), "special characters"),
    (lambda m: generate.json(m, {"type": "object"}, engine="outlines_core"), "beyond those listed"),
    (lambda m: generate.json(m, {"properties": {"foo": {}}}, engine="outlines_core"), "any kind"),
])
def test_what_outlines_core_would_serve_wrong_is_served_by_llguidance(model, build, reason):
    with pytest.warns(engines.EngineFallbackWarning, match=reason):
        gen = build(model)
    assert gen.engine == "llguidance"


def test_outlines_core_languages_are_the_schema_s(model):
    """What the routed cases above would lose: each is in the language served."""
    assert accepts(generate.choice(model, ["cat", "category"], engine="outlines_core"), "category")
    assert accepts(generate.json(model, {"type": "number"}, engine="outlines_core"), "2.5")
    assert not accepts(generate.json(model, {"const": {"a.b": 1}}, engine="outlines_core"), '{"axb":1}')
    closed = generate.json(model, {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                                   "additionalProperties": False}, engine="outlines_core")
    assert closed.engine == "outlines_core" and accepts(closed, '{"a":1}')


def test_a_generated_json_number_is_checked_on_value(model):
    schema = {"type": "object", "properties": {"x": {"type": "number", "maximum": -1e9}}, "required": ["x"]}
    gen = continuous(generate.json(model, schema, samplers.multinomial(4), whitespace_pattern=WS))
    state = gen("JSON:", max_tokens=30, seed=0)
    for s, text in enumerate(state._values):
        x = json.loads(text)["x"] if accepts(gen.generator, text) else None
        row = state[0, s, :]
        if x is not None and x <= -1e9:
            assert row.value == {"x": x}
        else:
            with pytest.raises(ValueError):
                row.value


def test_dates_are_real_calendar_dates():
    pattern = re.compile(DATE)
    for year in (1, 4, 100, 400, 1900, 1999, 2000, 2023, 2024, 2100, 9996, 9999):
        for month in range(0, 14):
            for day in range(0, 33):
                text = f"{year:04d}-{month:02d}-{day:02d}"
                try:
                    dt.date(year, month, day)
                    real = True
                except ValueError:
                    real = False
                assert bool(pattern.fullmatch(text)) == real, text
    assert not pattern.fullmatch("0000-01-01")


@pytest.mark.parametrize("build, text", [
    (lambda m: generate.format(m, dt.date), "2023-02-29"),
    (lambda m: generate.format(m, dt.datetime), "2023-04-31 10:00:00"),
    (lambda m: generate.json(m, {"type": "string", "format": "date"}), '"2100-02-29"'),
    (lambda m: generate.json(m, {"type": "string", "format": "date-time"}), '"2023-02-30T10:00:00Z"'),
])
def test_impossible_dates_are_not_in_the_constraint(model, build, text):
    gen = build(model)
    assert not accepts(gen, text)
    assert accepts(gen, text.replace("-29", "-28").replace("-31", "-30").replace("-30T", "-28T"))


@pytest.mark.parametrize("engine", ["llguidance", "outlines_core"])
def test_a_date_time_is_rfc_3339(model, engine):
    gen = generate.json(model, {"type": "string", "format": "date-time"}, engine=engine)
    for text in ['"2023-02-28T10:00:00Z"', '"2023-02-28T10:00:00+02:00"', '"2023-02-28T10:00:00.25-05:30"']:
        assert accepts(gen, text), text
    for text in ['"2023-02-28T10:00:00"', '"2023-02-28T10:00:00+24:00"', '"2023-02-28 10:00:00Z"']:
        assert not accepts(gen, text), text


@pytest.mark.parametrize("node, inside, outside", [
    ({"minimum": 0}, [0, 1.5, 2e-05], [-1.5, -3]),
    ({"exclusiveMinimum": 1.5}, [2.5, 1.75], [-2.0]),
    ({"maximum": -1}, [-1, -2.5], [0, 3.5]),
    ({"exclusiveMaximum": 0}, [-0.5], [0, 1]),
])
@pytest.mark.parametrize("engine", ENGINES)
def test_json_number_bounds_fix_the_sign_in_the_constraint(model, node, inside, outside, engine):
    schema = {"type": "object", "properties": {"n": {"type": "number", **node}}, "required": ["n"],
              "additionalProperties": False}
    gen = generate.json(model, schema, whitespace_pattern=WS, engine=engine)
    if engine == "llguidance":  # its bounded numbers take no exponent with a leading zero ("2e-05")
        inside = [v for v in inside if "e-0" not in json.dumps(v)]
    assert all(_doc_matches(gen, v) for v in inside)
    assert not any(_doc_matches(gen, v) for v in outside)


def test_a_byte_level_vocabulary_cannot_spell_split_characters_on_outlines_core():
    from support.models import build_arch

    from continuous import models

    hf, tok = build_arch("llama")  # Llama 3: an emoji is several byte tokens
    model = models.transformers(hf, tok)
    with pytest.warns(engines.EngineFallbackWarning, match="byte-level"):
        gen = generate.regex(model, r"[^a]{1,4}", engine="outlines_core")
    assert accepts(gen, "😀")
    assert generate.regex(model, r"[a-c]{2,4}", engine="outlines_core").engine == "outlines_core"
