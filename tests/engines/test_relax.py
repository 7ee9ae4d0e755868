"""Schemas the engine refuses only over keywords that narrow them: relaxed, enforced while
decoding, validated on value; and the forms normalized before compiling."""


import pytest
from support.constraints import accepts

from continuous import BanExhausted, continuous, generate
from continuous.engines import llguidance as llg
from continuous.engines.relax import draft7, normalize

ITEMS = {"type": "array", "items": {"enum": ["red", "green", "blue", "black"]}, "minItems": 3, "maxItems": 3}


def test_counts_given_as_whole_floats_are_integers():
    out = normalize({"type": "string", "minLength": 2.0, "maxLength": 5.5})
    assert out["minLength"] == 2 and isinstance(out["minLength"], int) and out["maxLength"] == 5.5


def test_draft_7_and_draft_4_forms_are_read_as_such():
    draft7 = {"$schema": "http://json-schema.org/draft-07/schema#", "type": "array",
              "items": [{"type": "integer"}, {"type": "string"}], "additionalItems": False}
    assert normalize(draft7) == {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}],
                                 "items": False}
    draft4 = {"type": "integer", "minimum": 3, "exclusiveMinimum": True, "maximum": 9, "exclusiveMaximum": False}
    assert normalize(draft4) == {"type": "integer", "exclusiveMinimum": 3, "maximum": 9}


def test_a_property_named_like_a_keyword_is_data():
    schema = {"type": "object", "properties": {"not": {"type": "integer"}}, "enum": [{"not": 1}],
              "uniqueItems": True}
    c = llg.json_schema({"type": "object", "properties": {"not": {"type": "integer"}}, "required": ["not"]},
                        _tok())
    assert c.dropped == frozenset()  # a property called "not" is no keyword
    assert normalize(schema)["properties"] == {"not": {"type": "integer"}}


@pytest.mark.parametrize("keyword, schema", [
    ("uniqueItems", dict(ITEMS, uniqueItems=True)),
    ("not", {"type": "string", "enum": ["a", "b"], "not": {"const": "a"}}),
    ("contains", dict(ITEMS, contains={"const": "black"})),
    ("oneOf", {"oneOf": [{"type": "integer"}, {"type": "number", "minimum": 0}]}),
    ("format", {"type": "string", "format": "no-such-format"}),
])
def test_what_the_engine_refuses_is_dropped_from_the_grammar(keyword, schema):
    assert keyword in llg.json_schema(schema, _tok()).dropped


def test_a_refusal_that_cannot_be_relaxed_says_why():
    schema = {"type": "array", "items": [{"type": "string", "pattern": "a("}], "additionalItems": False}
    with pytest.raises(ValueError, match="(?s)refuses.*regex"):
        llg.json_schema(schema, _tok())


@pytest.mark.parametrize("declared", [False, True])
def test_a_draft_7_schema_is_read_as_draft_7_whether_it_says_so_or_not(model, declared):
    schema = {"type": "object", "properties": {
        "pair": {"type": "array", "items": [{"type": "integer"}, {"type": "string"}], "additionalItems": False},
        "a": {"type": "integer"}, "b": {"type": "integer"}},
        "dependencies": {"a": ["b"]}}
    if declared:
        schema["$schema"] = "http://json-schema.org/draft-07/schema#"
    assert draft7(schema)
    assert normalize(schema)["dependentRequired"] == {"a": ["b"]}
    gen = generate.json(model, schema, whitespace="compact")
    assert accepts(gen, '{"pair":[1,"x"]}') and not accepts(gen, '{"pair":[1,"x",2]}')
    assert gen.parse('{"pair":[1,"x"],"a":1,"b":2}') == {"pair": [1, "x"], "a": 1, "b": 2}
    with pytest.raises(ValueError, match="dependentRequired"):
        gen.parse('{"a":1}')
    with pytest.raises(ValueError, match="pair"):
        gen.parse('{"pair":[1,2]}')


def test_a_2020_12_schema_is_not_read_as_draft_7():
    assert not draft7({"type": "array", "prefixItems": [{"type": "integer"}], "items": False})
    assert not draft7({"$schema": "https://json-schema.org/draft/2020-12/schema", "dependencies": {"a": ["b"]}})
    assert not draft7(True)


@pytest.mark.parametrize("keyword, schema", [
    ("uniqueItems", dict(ITEMS, uniqueItems=True)),
    ("contains", dict(ITEMS, contains={"const": "black"})),
    ("if/then", {"type": "object", "properties": {"kind": {"enum": ["a", "b"]}, "n": {"type": "integer",
                                                                                     "maximum": 99}},
                 "required": ["kind"], "additionalProperties": False,
                 "if": {"properties": {"kind": {"const": "a"}}}, "then": {"required": ["n"]}}),
])
def test_relaxed_schemas_give_valid_documents(model, keyword, schema):
    gen = continuous(generate.json(model, schema, sampler=None))
    for prompt in ["Colors: ", "JSON: ", "User: Tell me about Omar.\nAssistant: "]:
        state = gen(prompt, max_tokens=60)
        assert state.finish_reasons == ["eos"]
        state.value  # validated against the whole schema: raises if a keyword was broken


def test_a_value_the_grammar_allows_but_the_schema_forbids_is_avoided_while_decoding(model):
    prompt = "Colors: "
    free = continuous(generate.json(model, ITEMS))(prompt, max_tokens=60).value
    first = free[0]
    # The same array, but its first item may not be what the model chose: the row rewinds there.
    narrowed = dict(ITEMS, items={"enum": ITEMS["items"]["enum"], "not": {"const": first}})
    state = continuous(generate.json(model, narrowed))(prompt, max_tokens=60)
    assert first not in state.value and len(state.value) == 3
    assert state._rows.texts[0].count("[") == 1  # rewound inside the array, not started over


def test_no_way_on_ends_with_an_error_naming_the_keyword(model):
    impossible = {"type": "string", "enum": ["a"], "not": {"const": "a"}}
    with pytest.warns(BanExhausted, match=r"a value its schema forbids \('not' at the document\)"):
        state = continuous(generate.json(model, impossible))("Letter: ", max_tokens=10)
    assert state.finish_reasons == ["ban_exhausted"]
    with pytest.raises(ValueError, match="every way on was banned"):
        state.value


def _tok():
    from support.models import build_tokenizer

    return build_tokenizer(1000)


def test_value_says_what_cut_a_row_short(model):
    gen = continuous(generate.json(model, {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
                                   sampler=None))
    state = gen("Numbers: ", max_tokens=2)
    assert state.finish_reasons == ["length"]
    with pytest.raises(ValueError, match="cut short by max_tokens"):
        state.value
