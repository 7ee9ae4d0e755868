"""A row's bookkeeping in one call: text, stop strings, bans, rewinds, what may be streamed."""

import pytest

from continuous.ban import BanList
from continuous.decode.rows import RowState, StopStrings
from continuous.layout import encode


def _row(tokenizer, text="Hello", ban=None, healed=""):
    ids, ends = encode(tokenizer, text, special=True)
    return RowState.of(tokenizer, ids, text, ends, [ban.matcher()] if ban is not None else [], healed)


def _ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False).input_ids


NO_STOP = StopStrings([])


def test_stop_strings_find_the_earliest_completed_by_the_new_text():
    stops = StopStrings(["ab", "b", ""])
    assert stops.strings == ["ab", "b"] and stops.longest == 2
    assert stops.find("xxab", 1) == (2, 4)  # "a" came before, "b" completes both: the earliest wins
    assert stops.find("xab", 1) == (1, 3)
    assert stops.find("abxx", 1) is None  # only matches the new characters can complete
    assert StopStrings([]).find("anything", 3) is None


@pytest.mark.parametrize("text", ["Alice lives in Paris.", "order 😀 shipped", "Chloé"])
def test_tokens_added_one_by_one_spell_their_decode(tokenizer, text):
    row = _row(tokenizer)
    ids = _ids(tokenizer, " " + text)
    for t in ids:
        assert row.add(t, None, NO_STOP) == []
    row.flush()
    assert row.full_text == "Hello" + tokenizer.decode(ids)
    assert len(row.full_ends()) == len(row.written.context) + len(ids)
    assert row.full_ends()[-1] == len(row.full_text)
    assert list(row.full_ends()) == sorted(row.full_ends())


def test_a_stop_string_finishes_the_row_and_stays_out_of_the_value(tokenizer):
    row = _row(tokenizer)
    for t in _ids(tokenizer, " Bob. Then"):
        row.add(t, None, StopStrings(["."]))
        if row.finished:
            break
    assert row.finished and row.written.stop is not None
    assert row.value_text() == " Bob"
    assert row.full_text[: row.cut] == "Hello Bob."


def test_a_banned_match_rewinds_to_its_first_token_and_bans_it_there(tokenizer):
    row = _row(tokenizer, ban=BanList(["Paris"]))
    ids = _ids(tokenizer, " in Paris")
    matches = []
    for step, t in enumerate(ids):
        matches += row.add(t, step, NO_STOP)
        row.history.slots.append(step)
    matches += row.ending()  # "Paris" ends the text: the end of the row decides
    assert len(matches) == 1
    start, factor = matches[0].start, matches[0].factor
    assert row.written.text[start:] == "Paris" and factor == 0
    undone = row.rewind(matches[0], tokenizer)
    assert row.written.text in (" in", " in ")  # up to the end of the token before "Paris"
    assert undone.keep == len(row.tokens) and undone.removed == len(ids) - undone.keep
    assert undone.slots == list(range(undone.keep, len(ids))) and undone.steps == undone.slots
    assert row.history.bans == {undone.keep: {ids[undone.keep]: 0}}
    assert row.history.rewinds == 1 and not row.finished


def test_a_soft_banned_phrase_sampled_again_where_it_was_down_weighted_stands(tokenizer):
    row = _row(tokenizer, ban=BanList({"Paris": 0.5}))
    ids = _ids(tokenizer, " Paris")
    for step, t in enumerate(ids):
        row.add(t, step, NO_STOP)
    assert row.rewind(row.ending()[0], tokenizer) is not None
    for step, t in enumerate(ids[len(row.tokens):]):
        row.add(t, step, NO_STOP)
    match = row.ending()
    assert match and row.rewind(match[0], tokenizer) is None
    assert row.written.text == " Paris"


def test_release_holds_back_what_could_still_become_a_banned_match(tokenizer):
    row = _row(tokenizer, ban=BanList(["Parisian"]))
    out = ""
    for step, t in enumerate(_ids(tokenizer, " in Paris")):
        row.add(t, step, NO_STOP)
        out += row.release() or ""
    # "Paris" may still become "Parisian", and a rewind would take back its whole token " Paris".
    assert out == " in"
    row.finished = True
    assert row.release() == " Paris"
    assert row.release() is None  # finished and all given out


def test_a_copy_goes_its_own_way(tokenizer):
    row = _row(tokenizer, ban=BanList(["zz"]))
    row.add(_ids(tokenizer, " a")[0], 0, NO_STOP)
    twin = row.copy()
    for t in _ids(tokenizer, " b"):
        twin.add(t, 1, NO_STOP)
    assert row.written.text == " a" and twin.written.text == " a b"
    assert row.tokens != twin.tokens and row.history.watchers[0].text == " a"


def test_healed_text_is_not_part_of_the_value(tokenizer):
    row = _row(tokenizer, "H", healed="e")  # healing re-spells the input's "e"
    for t in _ids(tokenizer, "ello there"):
        row.add(t, None, NO_STOP)
    assert row.written.text == "ello there" and row.value_text() == "llo there"
    assert row.release() == "llo there"  # the re-spelled input was streamed as input


def test_stop_strings_and_bans_look_past_the_healed_text(tokenizer):
    row = _row(tokenizer, "Visit https://www.", ban=BanList(["exa"]), healed="exa")
    ids = _ids(tokenizer, "example.com")
    matches = [m for t in ids for m in row.add(t, None, StopStrings(["exa", "."]))]
    assert row.written.stop == (len("example"), len("example."))  # not the "exa" healing spelled again
    assert matches == [] and row.ending() == []
    assert row.value_text() == "mple"


def test_healed_text_not_spelled_again_by_the_end_of_the_call_is_given_back(tokenizer):
    row = _row(tokenizer, "Visit https://www.", healed="example")
    row.add(_ids(tokenizer, "ex")[0], None, NO_STOP)
    assert row.unspelled == "example"[len(row.written.text):] and row.unspelled
    for t in _ids(tokenizer, "example")[1:]:
        row.add(t, None, NO_STOP)
    assert row.unspelled == ""


def test_copies_share_no_mutable_field(tokenizer):
    """A copy shares no mutable field: a field that a part gains must be copied too (else this fails)."""
    import dataclasses

    row = _row(tokenizer, ban=BanList(["zz"]))
    for t in _ids(tokenizer, " a b"):
        row.add(t, 0, NO_STOP)
    row.history.bans[1] = {5: 0.0}
    twin = row.copy()
    for part, other in ((row, twin), (row.written, twin.written), (row.history, twin.history)):
        for f in dataclasses.fields(part):
            value = getattr(part, f.name)
            if not isinstance(value, (str, int, float, bool, tuple, type(None))):
                assert getattr(other, f.name) is not value, f.name
    assert twin.history.bans[1] is not row.history.bans[1]
    assert twin.history.watchers[0] is not row.history.watchers[0]
