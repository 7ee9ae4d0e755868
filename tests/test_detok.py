"""A state's text is the decode of its ids, also when calls stop inside a character."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from continuous import continuous, generate, models
from continuous.detok import Detokenizer, dangling
from continuous.samplers import Sampler
from continuous.testing import build_llama, real_tokenizer

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
        # Up to the last complete character the text is the decode of the ids; bytes of a
        # character still incomplete show as replacement characters (the decoder's own
        # output for them may even spoil the character before, so it is not compared).
        now = ids_of(state)
        complete = decoded(tok, now[: len(now) - dangling(tok, now)])
        assert str(state).startswith(complete)
        assert set(str(state)[len(complete):]) <= {"\ufffd"}
    assert str(state) == decoded(tok, ids_of(state))  # every word is whole at the end


@settings(max_examples=50, deadline=None)
@given(words=st.lists(st.sampled_from(WORDS), min_size=1, max_size=5), split=st.integers(0, 6))
def test_pieces_rebuild_the_text(model, words, split):
    tok = model.tokenizer
    ids = tok("".join(words), add_special_tokens=False).input_ids
    context, rest = ids[:split], ids[split:]
    detok = Detokenizer(tok, context[: len(context) - dangling(tok, context)])
    for t in context[len(context) - dangling(tok, context):]:
        assert detok.step(t) is None
    out = "".join(p or "" for p in map(detok.step, rest)) + detok.flush()
    whole = decoded(tok, ids)
    head = decoded(tok, context[: len(context) - dangling(tok, context)])
    assert out == whole[len(head):]


def test_a_copy_goes_on_alone(model):
    tok = model.tokenizer
    ids = tok("東京 🙂 wörld", add_special_tokens=False).input_ids
    detok = Detokenizer(tok, [])
    first = [detok.step(t) for t in ids[:4]]
    twin = detok.copy()
    a = "".join(p or "" for p in map(detok.step, ids[4:])) + detok.flush()
    b = "".join(p or "" for p in map(twin.step, ids[4:])) + twin.flush()
    assert a == b and "".join(p or "" for p in first) + a == decoded(tok, ids)
