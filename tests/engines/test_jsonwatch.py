"""The watch over what a relaxed JSON grammar dropped: where each violation sends the row back."""

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from continuous.engines.jsonwatch import Checks, JsonWatch

UNIQUE = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"},
                                                    "uniqueItems": True}}}
CONTAINS = {"type": "array", "items": {"type": "integer"}, "contains": {"const": 7}}
NOT = {"type": "object", "properties": {"city": {"type": "string", "not": {"const": "Lima"}},
                                        "n": {"type": "integer"}}}


def feed(schema, dropped, text, pieces=1):
    """Feed ``text``; the watch, and the violations of the first piece that makes any (a row
    rewinds there, so nothing after it would be fed)."""
    watch = JsonWatch(Checks(schema, dropped))
    for i in range(0, len(text), pieces):
        found = watch.feed(text[i:i + pieces])
        if found:
            return watch, _spans(found)
    return watch, _spans(watch.finish())


def _spans(matches):
    """``(start, factor, end)`` of value matches."""
    assert all(m.value for m in matches)
    return [(m.start, m.factor, m.end) for m in matches]


def test_a_repeated_item_goes_back_into_it():
    text = '{"tags": ["a", "b", "a"]}'
    _, found = feed(UNIQUE, {"uniqueItems"}, text)
    assert found == [(text.rindex('"a"'), 0.0, text.rindex('"a"') + 3)]  # the row rewinds into it
    assert feed(UNIQUE, {"uniqueItems"}, '{"tags": ["a", "b"]}')[1] == []


def test_a_value_the_schema_forbids_goes_back_into_it():
    text = '{"n": 1, "city": "Lima"}'
    _, found = feed(NOT, {"not"}, text)
    assert found == [(text.index('"Lima"'), 0.0, text.index('"Lima"') + 6)]
    assert feed(NOT, {"not"}, '{"n": 1, "city": "Oslo"}')[1] == []


def test_something_missing_goes_back_to_the_closing_brace_or_the_last_item():
    text = "[1, 2, 3]"
    _, found = feed(CONTAINS, {"contains"}, text)
    assert found == [(text.index("3"), 0.0, text.index("3") + 1)]  # the last item changes
    assert feed(CONTAINS, {"contains"}, "[1, 7]")[1] == []
    needs = {"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}
    text = '{"a": 1}'
    assert feed(needs, {"if", "then"}, text)[1] == [(len(text) - 1, 0.0, len(text))]  # more before the brace


def test_a_number_ending_the_document_is_checked_at_its_end():
    schema = {"type": "integer", "not": {"const": 3}}
    assert feed(schema, {"not"}, "3")[1] == [(0, 0.0, 1)]
    assert feed(schema, {"not"}, "31")[1] == []


def test_values_under_refs_and_pattern_properties_are_found():
    schema = {"type": "object", "$defs": {"word": {"type": "string", "not": {"const": "no"}}},
              "patternProperties": {"^x": {"$ref": "#/$defs/word"}}}
    text = '{"xa": "yes", "xb": "no"}'
    assert feed(schema, {"not"}, text)[1] == [(text.index('"no"'), 0.0, text.index('"no"') + 4)]


DOCS = st.lists(st.sampled_from(['"a"', '"b"', '"c\\\\"', '"d\\""', "1", "2"]), max_size=6).map(
    lambda items: '{"tags": [' + ", ".join(items) + "]}")


@settings(max_examples=100, deadline=None)
@given(text=DOCS, pieces=st.integers(1, 5), cut=st.integers(0, 40))
def test_a_rewind_equals_a_fresh_watch_fed_the_shorter_text(text, pieces, cut):
    schema = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}
    cut = min(cut, len(text))
    rewound, fresh = JsonWatch(Checks(schema, {"uniqueItems"})), JsonWatch(Checks(schema, {"uniqueItems"}))
    for i in range(0, len(text), pieces):
        rewound.feed(text[i:i + pieces])
    rewound.rewind(cut)
    for i in range(0, cut, pieces):
        fresh.feed(text[i:min(i + pieces, cut)])
    assert rewound.held() == fresh.held()
    rest = text[cut:]
    assert [rewound.feed(c) for c in rest] == [fresh.feed(c) for c in rest]
    json.loads(text)  # the strategy writes JSON


def test_held_text_starts_at_the_outermost_open_value():
    watch = JsonWatch(Checks(UNIQUE, {"uniqueItems"}))
    watch.feed('{"tags": ["a"')
    assert watch.held() == len('{"tags": ["a"')
    watch.feed("]}")
    assert watch.held() == 0


ONE_OF = {"type": "object", "properties": {"tagid": {"type": "string"}, "tagId": {"type": "string"},
                                           "floor": {"type": "number"}},
          "oneOf": [{"required": ["tagid"]}, {"required": ["tagId"]}]}


def test_exclusive_members_go_back_to_the_second_one_or_to_the_brace():
    text = '{"tagid": "a", "tagId": "b"}'  # both: the second member goes (from its comma)
    assert feed(ONE_OF, {"oneOf"}, text)[1] == [(text.index(", "), 0.0, len(text) - 1)]
    text = '{"floor": 1}'  # neither: one more member before the brace
    assert feed(ONE_OF, {"oneOf"}, text)[1] == [(len(text) - 1, 0.0, len(text))]
    text = '{"tagId": "b", "tagid": "a", "floor": 1}'  # the second one goes, with what follows it
    assert feed(ONE_OF, {"oneOf"}, text)[1] == [(text.index(", "), 0.0, len(text) - 1)]
    # A branch that fails only for a missing member can still be met: more members.
    union = {"type": "object", "oneOf": [
        {"properties": {"kind": {"const": "a"}, "x": {}}, "required": ["kind", "x"], "additionalProperties": False},
        {"properties": {"kind": {"const": "b"}, "y": {}}, "required": ["kind", "y"], "additionalProperties": False}]}
    text = '{"kind": "a"}'
    assert feed(union, {"oneOf"}, text)[1] == [(len(text) - 1, 0.0, len(text))]
    assert feed(union, {"oneOf"}, '{"kind": "a", "y": 1, "x": 2}')[1] != []  # y would have to go
    text = '{"kind": "a", "y": 1}'  # the wrong partner: it goes
    assert feed(union, {"oneOf"}, text)[1] == [(text.index(", "), 0.0, len(text) - 1)]
    assert feed(ONE_OF, {"oneOf"}, '{"floor": 1, "tagId": "b"}')[1] == []
