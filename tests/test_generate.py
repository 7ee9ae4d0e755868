"""generate.*: constraints hold, values parse, weights are the masked log-probabilities."""

import datetime as dt
import enum
import json
import re
from typing import Literal, Optional

import pytest
import torch
from outlines_core import Guide
from pydantic import BaseModel, Field

from continuous import continuous, generate, samplers
from continuous.guides import build_index

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
    if all(re.fullmatch(gen.regex, t) for t in state._values):
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


def test_index_is_built_once_per_regex_and_vocabulary(model):
    a = generate.regex(model, r"[a-c]{2,4}")
    b = generate.regex(model, r"[a-c]{2,4}")
    assert a.index is b.index
    assert build_index(r"[a-c]{2,4}", model.tokenizer) is a.index


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
    guide = Guide(gen_obj.index)
    total = 0.0
    for i, token in enumerate(generated):
        with torch.no_grad():
            logits = hf_model(torch.tensor([ids[: len(prompt_ids) + i]])).logits[0, -1].float()
        allowed = torch.zeros_like(logits, dtype=torch.bool)
        allowed[guide.get_tokens()] = True
        masked = logits.masked_fill(~allowed, -torch.inf)
        if hasattr(sampler, "process"):
            masked = sampler.process(masked[None])[0]
        total += torch.log_softmax(masked, -1)[token].item()
        guide.advance(token, return_tokens=False)
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


# ---------------------------------------------------------------- issue 9, item 2
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
    assert re.fullmatch(gen.regex, generated) is None  # the call was indeed cut short
    with pytest.raises(ValueError, match="cut short|does not parse"):
        state.value
    # The state stays usable: it prints, and it continues.
    assert str(state).endswith(generated)
    more = continuous(generate.text(model))(state, max_tokens=2)
    assert str(more).startswith(str(state))


def test_value_of_a_complete_match_parses(model):
    state = continuous(generate.choice(model, ["alphabetically", "betamaxes"]))("Answer:")
    assert state.value in ("alphabetically", "betamaxes")


# ---------------------------------------------------------------- issue 9, item 6
def test_bad_generator_arguments_fail_when_built(model):
    with pytest.raises(TypeError, match="continuous.models"):
        generate.text("path/to/model")
    with pytest.raises(TypeError, match="continuous.models"):
        generate.choice("gpt2", ["a", "b"])
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
    assert generate.regex(model, r"\$[0-9]{2}").regex == r"\$[0-9]{2}"
