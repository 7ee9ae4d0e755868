"""Rows: token boundaries, holes and their compaction."""

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from support.models import real_tokenizer
from support.states import assert_equivalent

from continuous import continuous, generate
from continuous.layout import Rows, encode, interior_holes, retokenize

TEXT = st.text(alphabet=st.sampled_from(list("ab lo {}\":,0123é€🙂\n")), max_size=30)


@pytest.fixture(scope="module", params=["bpe", "llama-spm"])  # byte-level BPE; SentencePiece with a dummy prefix
def any_tokenizer(request, tokenizer):
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
