"""A state's text is the decode of its ids, also when calls stop inside a character."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.models import build_llama, real_tokenizer

from continuous import continuous, generate, models
from continuous.detok import Detokenizer, dangling
from continuous.samplers import Sampler

WORDS = ["東京", "🙂", "wörld", " 你好", "€", " café", "😀👍", "a", " the"]


class Scripted(Sampler):
    """Chooses the given ids one after the other, whatever the logits (a test double)."""

    def __init__(self, ids):
        self.ids = list(ids)

    def __call__(self, logits, weights, rng=None):
        ids = torch.tensor([self.ids.pop(0)] * logits.shape[0], device=logits.device)
        return ids, torch.arange(logits.shape[0], device=logits.device), weights


@pytest.fixture(scope="module", params=["llama-spm", "qwen2"])  # byte fallback; byte-level BPE
def model(request):
    tok = real_tokenizer(request.param)
    hf = build_llama(tok, "tiny", max_position_embeddings=256, vocab_size=len(tok))
    return models.transformers(hf, tok)


def ids_of(state):
    return state.token_ids[0][state.attention_mask[0].bool()].tolist()


def decoded(tok, ids):
    return tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


@settings(max_examples=15, deadline=None)
@given(words=st.lists(st.sampled_from(WORDS), min_size=1, max_size=4))
def test_one_token_per_call_keeps_text_equal_to_the_decode_of_ids(model, words):
    tok = model.tokenizer
    prompt = "Say:"
    ids = tok("".join(words), add_special_tokens=False).input_ids
    state = continuous(generate.text(model))(prompt, max_tokens=0)
    for t in ids:  # one token per call: calls often stop inside a character
        state = continuous(generate.text(model, Scripted([t])))(state, max_tokens=1)
        # The text is the decode of the ids whenever that decode is whole characters; a
        # character still incomplete shows as replacement characters, which the next
        # call replaces by the character (it never repeats the context).
        whole = decoded(tok, ids_of(state))
        if "\ufffd" not in whole:
            assert str(state) == whole
        assert str(state).count(prompt) == 1
    assert str(state) == decoded(tok, ids_of(state))  # every word is whole at the end


@settings(max_examples=50, deadline=None)
@given(words=st.lists(st.sampled_from(WORDS), min_size=1, max_size=5), split=st.integers(0, 6))
def test_a_context_that_ends_inside_a_character_is_decoded_again(model, words, split):
    tok = model.tokenizer
    ids = tok("".join(words), add_special_tokens=False).input_ids
    context, rest = ids[:split], ids[split:]
    held = dangling(tok, context)
    detok = Detokenizer(tok, context[: len(context) - held])
    for t in context[len(context) - held:]:
        assert detok.step(t) is None
    out = "".join(p or "" for p in map(detok.step, rest)) + detok.flush()
    assert out == decoded(tok, ids)[len(decoded(tok, context[: len(context) - held])):]


def test_a_copy_goes_on_alone(model):
    tok = model.tokenizer
    ids = tok("東京 🙂 wörld", add_special_tokens=False).input_ids
    detok = Detokenizer(tok, [])
    first = [detok.step(t) for t in ids[:4]]
    twin = detok.copy()
    a = "".join(p or "" for p in map(detok.step, ids[4:])) + detok.flush()
    b = "".join(p or "" for p in map(twin.step, ids[4:])) + twin.flush()
    assert a == b and "".join(p or "" for p in first) + a == decoded(tok, ids)


# The Detokenizer alone: pieces concatenate to the decode of the ids.
# Byte-fallback SentencePiece (Llama 2) and byte-level BPE (Qwen2): both split CJK and
# emoji across tokens.
NAMES = ["llama-spm", "qwen2"]
TEXTS = ["User: Hi\nAssistant:", "日本語のテキスト", "emoji 🙂🚀 and ünïcödé", " 你好, world", ""]


@pytest.fixture(scope="module", params=NAMES)
def tok(request):
    return real_tokenizer(request.param)


def _decode(tok, ids):
    return tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _pieces(tok, context, ids, calls):
    """Decode ``ids`` after ``context`` in calls of a few tokens, each call a new
    Detokenizer (as a state continued call after call) flushed at its end; a piece
    replaces the ``replaced`` characters before it."""
    text, done, start = "", list(context), 0
    for size in calls + [len(ids)]:
        chunk = ids[start:start + size]
        if not chunk:
            continue
        detok = Detokenizer(tok, done)
        for i in chunk + [None]:
            piece = detok.step(i) if i is not None else detok.flush()
            if piece is not None:
                text = text[:len(text) - detok.replaced] + piece
        done += chunk
        start += size
    return text


def _after(tok, context: str, text: str) -> tuple[list[int], list[int]]:
    """The ids of ``context``, and those of ``text`` as the tokenizer gives them after it
    (encoded alone, it would start with SentencePiece's "▁" for the start of a text)."""
    before = tok.encode(context, add_special_tokens=False)
    ids = tok.encode(context + text, add_special_tokens=False)
    assert ids[:len(before)] == before
    return before, ids[len(before):]


def _byte_heavy_ids(tok, data):
    """Ids that include the vocabulary's byte tokens and pieces of multi-byte characters."""
    text = data.draw(st.text(alphabet=st.sampled_from(list("aé你好🙂🚀日本 \n")), max_size=12))
    ids = tok.encode(text, add_special_tokens=False)
    vocab = len(tok)
    extra = data.draw(st.lists(st.integers(0, vocab - 1), max_size=6))
    cut = data.draw(st.integers(0, len(ids)))
    return ids[:cut] + extra + ids[cut:]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_pieces_concatenate_to_the_decode(tok, data):
    context = tok.encode(data.draw(st.sampled_from(TEXTS)), add_special_tokens=False)
    ids = _byte_heavy_ids(tok, data)
    assert _pieces(tok, context, ids, []) == _decode(tok, context + ids)[len(_decode(tok, context)):]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_one_token_per_call_never_repeats_the_context(tok, data):
    # A call ends inside a character and the next one completes
    # it; the old detokenizer then gave out the whole context again.
    context = tok.encode("User: Hi\nAssistant:", add_special_tokens=False)
    ids = _byte_heavy_ids(tok, data)
    calls = data.draw(st.lists(st.integers(1, 3), max_size=len(ids)))
    text = _pieces(tok, context, ids, calls)
    assert text == _decode(tok, context + ids)[len(_decode(tok, context)):]


@pytest.mark.parametrize("name", NAMES)
def test_cjk_and_emoji_one_token_at_a_time(name):
    tok = real_tokenizer(name)
    context, ids = _after(tok, "Q:", " 你好🙂 world 日本")
    detok = Detokenizer(tok, context)
    pieces = [detok.step(i) for i in ids]
    # Every piece is whole characters: no replacement character is ever given out.
    assert all(p is None or "\ufffd" not in p for p in pieces)
    assert "".join(p for p in pieces if p is not None) + detok.flush() == " 你好🙂 world 日本"


def test_copy_is_independent():
    tok = real_tokenizer("llama-spm")
    context, ids = _after(tok, "x", " 🙂🚀")
    detok = Detokenizer(tok, context)
    first = [detok.step(i) for i in ids[:3]]
    twin = detok.copy()
    rest = [detok.step(i) for i in ids[3:]]
    rest_twin = [twin.step(i) for i in ids[3:]]
    assert rest == rest_twin
    held = twin.flush()
    assert held == detok.flush()
    assert "".join(p for p in first + rest if p) + held == " 🙂🚀"


def test_a_character_completed_by_the_next_call_replaces_its_placeholder():
    # A call ends inside a character (flushed as U+FFFD), and the
    # next call completes it; the text must become the decode, the context not repeated.
    tok = real_tokenizer("qwen2")
    context = tok.encode("User: Hi\nAssistant:", add_special_tokens=False)
    ids = tok.encode("߆", add_special_tokens=False)
    assert len(ids) == 2
    first = Detokenizer(tok, context)
    assert first.step(ids[0]) is None and first.flush() == "\ufffd"
    second = Detokenizer(tok, context + ids[:1])
    assert second.step(ids[1]) == "߆" and second.replaced == 1
    assert _pieces(tok, context, ids, [1, 1]) == "߆"


def test_slow_tokenizer_is_refused():
    with pytest.raises(TypeError, match="tokenizers"):
        Detokenizer(object(), [])
