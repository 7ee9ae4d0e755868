"""Rows: token boundaries, holes and their compaction."""

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from support.models import real_tokenizer
from support.states import assert_equivalent

from continuous import continuous, generate
from continuous.layout import Rows, Text, encode, interior_holes, retokenize

TEXT = st.text(alphabet=st.sampled_from(list("ab lo {}\":,0123é€🙂\n")), max_size=30)


@pytest.fixture(scope="module", params=["bpe", "llama-spm"])  # byte-level BPE; SentencePiece with a dummy prefix
def any_tokenizer(request, tokenizer):
    return tokenizer if request.param == "bpe" else real_tokenizer(request.param)


@pytest.fixture(scope="module", params=["bpe", "qwen2", "llama-spm"])  # specials: <s> </s>; ChatML's; SentencePiece's
def special_tokenizer(request, tokenizer):
    return tokenizer if request.param == "bpe" else real_tokenizer(request.param)


@settings(max_examples=200, deadline=None)
@given(left=TEXT, right=TEXT)
@example(left="🙂", right="0")  # byte-fallback tokens, then text re-encoded alone
def test_appending_text_tokenizes_like_the_whole_text(any_tokenizer, left, right):
    tokenizer = any_tokenizer
    ids, ends = encode(tokenizer, left, special=True)
    keep, new_ids, new_ends = retokenize(tokenizer, ids, ends, left, len(left), right)
    whole_ids, whole_ends = encode(tokenizer, left + right, special=True)
    assert ids[:keep] + new_ids == whole_ids
    assert list(ends[:keep]) + new_ends == whole_ends


@settings(max_examples=200, deadline=None)
@given(text=TEXT, cut=st.integers(0, 30))
@example(text=',"', cut=1)  # SentencePiece: "▁", ",\"" (the dummy prefix alone, then a token that spells the comma)
def test_cutting_text_tokenizes_like_the_cut_text(any_tokenizer, text, cut):
    tokenizer = any_tokenizer
    ids, ends = encode(tokenizer, text, special=True)
    keep, new_ids, _ = retokenize(tokenizer, ids, ends, text, min(cut, len(text)), "")
    assert ids[:keep] + new_ids == encode(tokenizer, text[:cut], special=True)[0]


def test_rows_edit_makes_holes_and_keeps_other_rows(tokenizer):
    rows = Rows.from_texts(tokenizer, ["Alice is here", "Bob"])
    cut = rows.with_text(tokenizer, [5, 3], ["", " too"])
    assert cut.texts == ("Alice", "Bob too")
    assert cut.real_ids(0) == tokenizer("Alice").input_ids
    assert cut.real_ids(1) == tokenizer("Bob too").input_ids
    assert cut.attention_mask.shape[0] == 2


def test_tokens_the_tokenizer_would_split_otherwise_are_kept(tokenizer):
    """A generated, non-canonical token sequence is not re-encoded when text is appended."""
    text = "Alice lives"
    chars = [tokenizer.convert_tokens_to_ids(c if c != " " else "Ġ") for c in text]
    ids = [tokenizer.bos_token_id] + chars
    ends = [0] + list(range(1, len(text) + 1))
    keep, new_ids, new_ends = retokenize(tokenizer, ids, ends, text, len(text), "\nBob")
    assert keep == len(ids)
    assert new_ids == tokenizer("\nBob", add_special_tokens=False).input_ids
    assert new_ends[-1] == len(text) + 4
    # a merge across the boundary re-encodes only the old tokens it reaches
    keep, new_ids, _ = retokenize(tokenizer, ids, ends, text, len(text), "s and")
    assert len(ids) - keep <= 6
    assert tokenizer.decode(ids[1:keep] + new_ids) == text + "s and"


def test_alternating_long_and_short_turns_keep_slots_near_tokens(model):
    gen = continuous(generate.text(model))
    state = gen(["User: Hi\nAssistant:", "User: Hello there\nAssistant:"], max_tokens=2)
    long_text = " ".join(["word"] * 12)
    new = len(model.tokenizer(long_text + "\nAssistant:", add_special_tokens=False).input_ids)
    for turn in range(8):
        texts = [long_text, " ok"] if turn % 2 == 0 else [" ok", long_text]
        before = state.attention_mask.sum(1).max().item()
        state = gen(state + [t + "\nAssistant:" for t in texts], max_tokens=3)
        # Holes of the cached part are squeezed out at each call: the grid is the longest
        # row's tokens plus this call's new ones, not the history of both rows.
        assert state.token_ids.shape[1] <= before + 1.125 * new + 3 + 2
    assert_equivalent(gen, state, n=4)


def test_compaction_keeps_every_row_and_its_cache(model):
    gen = continuous(generate.text(model))
    state = gen(["a b c d e f g h i j k l m n o p", "x"], max_tokens=2)
    state = state + ["", " " + "y " * 40]
    state = gen(state, max_tokens=2)
    state = state + [" " + "z " * 40, ""]
    assert interior_holes(state.attention_mask)
    assert_equivalent(gen, state, n=5)


def test_interior_holes():
    assert not interior_holes(torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]]))
    assert interior_holes(torch.tensor([[0, 1, 0, 1], [1, 1, 1, 1]]))
    assert not interior_holes(torch.tensor([[1, 1, 0, 0]]))  # trailing holes: nothing after them


def _plain_chars(text) -> set[int]:
    return {i for a, b in getattr(text, "plain", ()) for i in range(a, b)}


#: Pieces of a text: (text, in a plain span?).
PIECES = st.lists(st.tuples(TEXT, st.booleans()), max_size=6)


def _text(pieces) -> Text:
    text, plain = "", []
    for piece, is_plain in pieces:
        if is_plain:
            plain.append((len(text), len(text) + len(piece)))
        text += piece
    return Text(text, plain)


@settings(max_examples=300, deadline=None)
@given(pieces=PIECES, other=TEXT, cut=st.tuples(st.integers(-40, 40), st.integers(-40, 40)))
def test_slices_and_sums_of_a_text_keep_its_plain_characters(pieces, other, cut):
    text = _text(pieces)
    chars = _plain_chars(text)
    part = text[cut[0]:cut[1]]
    start, stop, _ = slice(*cut).indices(len(text))
    assert part == str(text)[cut[0]:cut[1]]
    assert _plain_chars(part) == {i - start for i in chars if start <= i < stop}
    assert _plain_chars(text + other) == chars and text + other == str(text) + other
    assert _plain_chars(other + text) == {i + len(other) for i in chars} and other + text == other + str(text)
    assert _plain_chars(text + text) == chars | {i + len(text) for i in chars}
    assert type(str(text)) is str and type(text.replace("a", "a")) is str


def _specials(tokenizer) -> list[str]:
    return sorted(t.content for t in tokenizer.added_tokens_decoder.values() if t.special)[:4]


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_special_tokens_text_in_plain_spans_is_encoded_as_text(special_tokenizer, data):
    tokenizer = special_tokenizer
    specials = _specials(tokenizer)
    pieces = data.draw(st.lists(st.tuples(st.one_of(TEXT, st.sampled_from(specials)), st.booleans()), max_size=8))
    text = _text(pieces)
    ids, ends = encode(tokenizer, text, special=True)
    # Special ids are those of the special tokens outside plain spans, in order (a BOS added before all).
    wanted = [tokenizer.convert_tokens_to_ids(p) for p, is_plain in pieces if p in specials and not is_plain]
    special_ids = {tokenizer.convert_tokens_to_ids(s) for s in specials}
    found = [i for i, e in zip(ids, ends) if i in special_ids and e > 0]
    assert found == wanted
    assert ends == sorted(ends) and (not text or ends[-1] == len(text))
    # Without special text in a plain span, a Text encodes exactly as its str.
    clean = _text([(p, is_plain and p not in specials) for p, is_plain in pieces])
    if not any(s in str(clean)[a:b] for a, b in clean.plain for s in specials):
        assert encode(tokenizer, clean, special=True) == encode(tokenizer, str(clean), special=True)


def test_a_text_starting_with_the_bos_text_as_plain_text_still_gets_the_bos(tokenizer):
    text = Text("<s>hello", [(0, 3)])
    ids, _ = encode(tokenizer, text, special=True)
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    assert encode(tokenizer, str(text), special=True)[0].count(tokenizer.bos_token_id) == 1  # the text's own BOS
