"""Values while they stream: each row's value parsed so far, then the complete value."""

import asyncio
import enum
import json
from typing import Optional

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, Field

from continuous import continuous, generate, models
from continuous.partial import PartialValues, construct


class Pet(BaseModel):
    kind: str
    age: int


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int
    tags: list[str] = Field(max_length=3)
    pets: list[Pet] = Field(max_length=2)
    best: Optional[Pet] = None
    counts: dict[str, int] = Field(max_length=2)


@pytest.fixture(scope="module")
def demo():
    from continuous.assets import DEMO_MODEL

    return models.transformers(DEMO_MODEL, dtype=torch.float32)


def grows(before, after, final) -> None:
    """``before`` -> ``after`` only adds: fields and items stay, strings extend, toward ``final``."""
    if isinstance(final, BaseModel):
        assert before.model_fields_set <= after.model_fields_set <= final.model_fields_set
        for name in before.model_fields_set:
            grows(getattr(before, name), getattr(after, name), getattr(final, name))
    elif isinstance(final, list):
        assert len(before) <= len(after) <= len(final)
        for b, a, f in zip(before, after, final):
            grows(b, a, f)
    elif isinstance(final, dict):
        assert set(before) <= set(after) <= set(final)
        for key in before:
            grows(before[key], after[key], final[key])
    elif isinstance(final, str):
        assert final.startswith(after) and after.startswith(before)
    elif isinstance(final, int) and not isinstance(final, bool):
        assert str(abs(final)).startswith(str(abs(after))) and str(abs(after)).startswith(str(abs(before)))
    else:
        assert before == after == final


_names = st.text(st.sampled_from("abcé xyz\"\\\n"), max_size=12)
_pets = st.builds(Pet, kind=_names, age=st.integers(-10**6, 10**6))
_people = st.builds(Person, name=_names, age=st.integers(-99, 10**9), tags=st.lists(_names, max_size=3),
                    pets=st.lists(_pets, max_size=2), best=st.none() | _pets,
                    counts=st.dictionaries(_names, st.integers(0, 99), max_size=2))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(person=_people, indent=st.sampled_from([None, 2]), cuts=st.lists(st.integers(0, 400), max_size=40))
def test_partial_values_only_grow_toward_the_value(model, person, indent, cuts):
    text = json.dumps(person.model_dump(), indent=indent)
    bounds = sorted({c for c in cuts if c < len(text)} | {0, len(text)})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    values = PartialValues(generate.json(model, Person), lambda rows: rows[0])
    seen = [values([p]) for p in pieces]
    final = Person.model_validate_json(text)
    assert seen[-1] == final  # the whole document: every field, as validation gives it
    first = next((i for i, v in enumerate(seen) if v is not None), len(seen))
    assert all(v is None for v in seen[:first])  # nothing before the document starts
    for before, after in zip(seen[first:], seen[first + 1:]):
        assert isinstance(after, Person)
        grows(before, after, final)


class Record(BaseModel):
    name: str
    age: int
    city: str
    pet: str


ASK = "Describe a person as JSON:\n"


def test_a_stream_yields_partial_models_then_the_validated_value(demo):
    gen = continuous(generate.json(demo, Record))
    texts = list(gen.stream(ASK, max_tokens=80))
    stream = gen.stream(ASK, partial=True, max_tokens=80)
    values = list(stream)
    assert len(values) == len(texts) + 1
    final = stream.state.value
    assert values[-1] == final and isinstance(final, Record)
    so_far = ""
    for piece, value in zip(texts, values):
        so_far += piece
        if value is None:
            assert not so_far.strip()
            continue
        assert isinstance(value, Record)
        # Nothing validated until complete: the fields written so far, each a prefix of its end.
        for name in value.model_fields_set:
            assert str(getattr(final, name)).startswith(str(getattr(value, name)))
    assert any(0 < len(v.model_fields_set) < 4 for v in values[:-1] if v is not None)


def test_a_dict_schema_streams_plain_data(demo):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    gen = continuous(generate.json(demo, schema))
    values = list(gen.stream(ASK, partial=True, max_tokens=60))
    assert values[-1] == gen(ASK, max_tokens=60).value
    assert all(v is None or isinstance(v, dict) for v in values)
    assert {} in values[:-1]


def test_a_batch_streams_values_shaped_as_value(demo):
    gen = continuous(generate.json(demo, Record))
    prompts = [ASK, "User: Describe a person as JSON.\nAssistant:"]
    values = list(gen.stream(prompts, partial=True, max_tokens=80, seed=2, temperature=1.0))
    assert all(isinstance(v, list) and len(v) == 2 for v in values)
    assert values[-1] == gen(prompts, max_tokens=80, seed=2, temperature=1.0).value


def test_a_string_being_written_shows_its_prefix(model):
    text = '{"name": "Rosa Li", "age": 41, "tags": ["ab", "c'
    values = PartialValues(generate.json(model, Person), lambda rows: rows[0])
    seen = [values([ch]) for ch in text]
    start = text.index("Rosa")
    for end in range(start, start + len("Rosa Li")):
        assert seen[end].name == text[start:end + 1]
    assert seen[text.index('"age"') + 7].age == 4 and seen[-1].age == 41
    assert seen[-1].tags == ["ab", "c"]


def test_with_a_thinking_section_values_read_the_answer_only(demo):
    from continuous import Think

    gen = continuous(generate.json(demo, Record, think=Think(budget=4)))
    pieces = list(gen.stream(ASK, max_tokens=80))
    stream = gen.stream(ASK, partial=True, max_tokens=80)
    values = list(stream)
    assert values[-1] == stream.state.value and isinstance(values[-1], Record)
    so_far = ""
    for piece, value in zip(pieces, values):
        so_far += piece
        if "</think>" not in so_far:
            assert value is None  # still thinking: nothing of the answer yet
        elif value is not None:
            assert isinstance(value, Record)
    assert any(isinstance(v, Record) and len(v.model_fields_set) < 4 for v in values[:-1])

    text = continuous(generate.text(demo, think=Think(budget=3)))
    stream = text.stream("User: Tell me about Rosa.\nAssistant:", partial=True, max_tokens=12)
    values = list(stream)
    answer = stream.state.value
    assert values[-1] == answer and values[0] == "" and values[-2] == answer
    assert all(answer.startswith(v) for v in values)


def test_list_and_nested_types_are_built_as_partial_models(model):
    assert construct(list[Pet], [{"kind": "cat"}, {}]) == [Pet.model_construct(kind="cat"), Pet.model_construct()]
    assert construct(dict[str, Pet], {"a": {"age": 3}})["a"].model_fields_set == {"age"}
    assert construct(Optional[Pet], {"kind": "x"}).kind == "x"
    assert construct(Optional[Pet], None) is None
    assert construct(Person, {"pets": [{"kind": "d"}]}).pets[0].kind == "d"


class Mood(enum.Enum):
    HAPPY = "happy"
    SAD = "sad"


@pytest.mark.parametrize("build, prompt", [
    (lambda m: generate.text(m), "Once upon a time"),
    (lambda m: generate.regex(m, r"[a-z]{3,8}-[0-9]{2}"), "Code: "),
    (lambda m: generate.choice(m, Mood), "Mood: "),
], ids=["text", "regex", "choice"])
def test_other_generators_stream_their_text_so_far(model, build, prompt):
    gen = continuous(build(model))
    pieces = list(gen.stream(prompt, max_tokens=8))
    stream = gen.stream(prompt, partial=True, max_tokens=8)
    values = list(stream)
    assert values[:-1] == ["".join(pieces[: i + 1]) for i in range(len(pieces))]
    assert values[-1] == stream.state.value


def test_astream_yields_partial_values(demo):
    gen = continuous(generate.json(demo, Record))

    async def collect():
        stream = gen.astream(ASK, partial=True, max_tokens=80)
        return [v async for v in stream], stream.state

    values, state = asyncio.run(collect())
    assert values[-1] == state.value == gen(ASK, max_tokens=80).value
    assert isinstance(values[-2], Record)


def test_a_value_cut_short_raises_at_the_end_and_keeps_the_state(model):
    gen = continuous(generate.json(model, Person))
    stream = gen.stream("Person: ", partial=True, max_tokens=3)
    values = []
    with pytest.raises(ValueError, match="cut short by max_tokens"):
        for v in stream:
            values.append(v)
    assert len(values) >= 1 and (values[-1] is None or isinstance(values[-1], Person))
    assert len(str(stream.state)) > len("Person: ")
    with pytest.raises(StopIteration):
        next(stream)


def test_calls_refuse_partial(model):
    with pytest.raises(TypeError):
        continuous(generate.text(model))("x", partial=True)


@pytest.mark.slow
@pytest.mark.real
def test_partial_values_grow_on_smollm2():
    from support.real import smollm2

    from continuous import chat

    class City(BaseModel):
        name: str
        country: str
        population: int
        landmarks: list[str] = Field(max_length=3)

    model = models.transformers(smollm2())
    gen = continuous(generate.json(model, City))
    ask = chat.prompt(model, [{"role": "user", "content": "Describe Paris as JSON: name, country, population, "
                                                          "three landmarks."}])
    stream = gen.stream(ask, partial=True, max_tokens=150)
    values = list(stream)
    final = stream.state.value
    assert values[-1] == final and final.name == "Paris" and len(final.landmarks) >= 1
    partial = [v for v in values[:-1] if v is not None]
    for before, after in zip(partial, partial[1:]):
        grows(before, after, final)
    # Strings were shown while written: some landmark appeared as a strict prefix of itself.
    assert any(v.landmarks and v.landmarks[-1] not in final.landmarks for v in partial
               if "landmarks" in v.model_fields_set)
