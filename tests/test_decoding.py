"""The decoding loop's edge cases: beams left without tokens, streaming beams, empty rows, the index cache."""

import pytest
import torch

from continuous import continuous, generate, guides, models, samplers
from continuous.testing import build_llama, real_tokenizer


def test_a_beam_left_without_allowed_tokens_has_no_value_and_can_be_continued(model):
    state = continuous(generate.choice(model, ["yes", "no"], samplers.beam_search(3)))("Answer: ")
    values = state.value
    assert sorted(v for v in values if v is not None) == ["no", "yes"]
    dead = values.index(None)
    assert state.weights[0, dead] == -torch.inf
    assert torch.isfinite(state.weights[0, [r for r in range(3) if r != dead]]).all()
    assert list(state)[dead] == "Answer: "  # not a copy of a finished beam
    # After text is added, any generator continues it, the dead row included.
    more = state + " then"
    out = continuous(generate.text(model, samplers.multinomial(3)))(more, max_tokens=3, seed=1)
    assert len(list(out)[dead]) > len(list(more)[dead])
    assert out.value[dead] is not None
    out = continuous(generate.regex(model, "[a-c]{2}", samplers.beam_search(3)))(more)
    assert all(v is not None and len(v) == 2 for v in out.value)


def test_streaming_beams_is_refused_clearly(model):
    gen = continuous(generate.text(model, samplers.beam_search(2)))
    with pytest.raises(ValueError, match="beam search cannot stream"):
        gen.stream("Hi", max_tokens=2)
    assert len(gen("Hi", max_tokens=2).value) == 2  # calling it works


def test_an_empty_row_without_bos_is_a_clear_error():
    tok = real_tokenizer("llama-bpe")  # adds no BOS
    hf = build_llama(tok, "tiny", max_position_embeddings=64, vocab_size=len(tok))
    gen = continuous(generate.text(models.transformers(hf, tok)))
    with pytest.raises(ValueError, match=r"empty sequence \(row 1\)"):
        gen(["Hello", ""], max_tokens=2)
    assert len(gen(["Hello", "x"], max_tokens=2).value) == 2


def test_the_index_cache_is_bounded(model, monkeypatch):
    monkeypatch.setattr(guides, "MAX_INDEXES", 3)
    first = guides.build_index("a{1,2}", model.tokenizer)
    assert guides.build_index("a{1,2}", model.tokenizer) is first
    for n in range(3, 8):
        guides.build_index(f"b{{1,{n}}}", model.tokenizer)
    assert len(guides._INDEXES) == 3
    assert guides.build_index("a{1,2}", model.tokenizer) is not first  # evicted, rebuilt
