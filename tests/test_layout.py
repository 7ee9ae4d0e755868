"""Token boundaries and incremental text of rows."""

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from continuous.layout import Rows, encode, retokenize
from support.models import real_tokenizer

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
