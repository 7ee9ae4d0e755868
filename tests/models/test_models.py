"""models.transformers: loading, stats, and the forward over a cache with holes."""

import pytest
import torch
from support.models import build_model_dir

from continuous import continuous, generate, models
from continuous.models.base import Stats
from continuous.models.transformers import check_causal


def test_loads_from_a_path_and_counts_its_work(tmp_path_factory):
    path = build_model_dir(tmp_path_factory.mktemp("m") / "tiny", size="tiny", seed=3)
    model = models.transformers(path, dtype=torch.float32)
    assert model.tokenizer.is_fast and model.vocab_size >= len(model.tokenizer)
    state = continuous(generate.text(model))("Alice", max_tokens=3)
    n_prompt = len(model.tokenizer("Alice").input_ids)
    assert model.stats.tokens_forwarded == n_prompt + 2
    assert model.stats.forward_calls == 3
    assert model.stats.snapshot()["positions_forwarded"] == n_prompt + 2
    model.stats.reset()
    assert model.stats == Stats()
    assert str(state).startswith("Alice")


def test_the_same_hf_model_gives_the_same_backend(hf_model, tokenizer, model):
    assert models.transformers(hf_model, tokenizer) is model
    with pytest.raises(TypeError):
        models.transformers(hf_model)


def test_forward_with_holes_matches_a_plain_forward(model, hf_model, tokenizer):
    ids = torch.tensor([tokenizer("Alice lives in Paris with a cat.").input_ids])
    with torch.no_grad():
        ref = hf_model(ids).logits[0, -1]
    holes = torch.zeros(1, 3, dtype=torch.long)
    grid = torch.cat([ids[:, :4], holes, ids[:, 4:]], 1)
    mask = torch.cat([torch.ones(1, 4, dtype=torch.long), holes, torch.ones_like(ids[:, 4:])], 1)
    _, cache = model.forward(grid[:, :6], mask[:, :6], None)
    logits, cache = model.forward(grid[:, 6:], mask, cache)
    torch.testing.assert_close(logits[0, -1], ref, atol=1e-4, rtol=1e-4)
    assert cache.length == grid.shape[1]
    with pytest.raises(ValueError):
        model.forward(grid[:, 6:], mask[:, :5], cache)


@pytest.mark.parametrize("kind, params", [
    ("t5", dict(d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8, vocab_size=64)),
    ("bert", dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=64)),
])
def test_a_model_that_is_not_a_causal_lm_is_refused(tmp_path, tokenizer, kind, params):
    from transformers import AutoConfig, AutoModel

    config = AutoConfig.for_model(kind, **params)
    AutoModel.from_config(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="decoder-only causal LM"):
        models.transformers(tmp_path)
    if kind == "bert":
        from transformers import BertLMHeadModel

        with pytest.raises(ValueError, match="encoder"):
            models.transformers(BertLMHeadModel(config), tokenizer)


# ---------------------------------------------------------------- loading options and errors
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("load") / "tiny", size="tiny", seed=5)


@pytest.mark.parametrize("dtype, expected", [("bfloat16", torch.bfloat16), ("float32", torch.float32),
                                             (torch.float16, torch.float16), ("auto", torch.float32)])
def test_dtype_may_be_a_name_or_auto(saved, dtype, expected):
    assert models.transformers(saved, dtype=dtype).dtype == expected


def test_other_keywords_go_to_from_pretrained(saved):
    model = models.transformers(saved, attn_implementation="eager", revision="main", low_cpu_mem_usage=True)
    assert model.model.config._attn_implementation == "eager"
    with pytest.raises(TypeError, match="need a path"):
        models.transformers(model.model, model.tokenizer, attn_implementation="eager")


def test_loading_errors_say_what_to_pass(saved, tmp_path, tokenizer):
    with pytest.raises(FileNotFoundError, match="no model folder at"):
        models.transformers(tmp_path / "missing" / "model")
    with pytest.raises(FileNotFoundError, match="is a file: pass the folder"):
        models.transformers(saved / "config.json")
    with pytest.raises(TypeError, match="loaded tokenizer"):
        models.transformers(saved, str(saved))
    with pytest.raises(ValueError, match="dtype must be"):
        models.transformers(saved, dtype="float33")
    with pytest.raises(ValueError, match="dtype must be"):
        models.transformers(saved, dtype="nn")


@pytest.mark.parametrize("kind, params", [
    ("distilbert", dict(dim=16, hidden_dim=32, n_layers=1, n_heads=2, vocab_size=64)),
    ("deberta-v2", dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                        vocab_size=64)),
])
def test_an_encoder_whose_config_has_no_is_decoder_is_refused_as_an_encoder(tmp_path, tokenizer, kind, params):
    from transformers import AutoConfig, AutoModelForMaskedLM

    config = AutoConfig.for_model(kind, **params)
    with pytest.raises(ValueError, match="is an encoder"):
        check_causal(config)
    with pytest.raises(ValueError, match="is an encoder"):
        models.transformers(AutoModelForMaskedLM.from_config(config), tokenizer)


def test_a_base_model_without_a_language_model_head_is_refused(hf_model, tokenizer):
    from transformers import AutoModel

    base = AutoModel.from_config(hf_model.config)
    with pytest.raises(ValueError, match="no language-model head.*AutoModelForCausalLM"):
        models.transformers(base, tokenizer)


def test_a_model_cast_or_moved_gets_a_wrapper_that_says_so(tokenizer):
    from support.models import build_llama

    hf = build_llama(tokenizer, "tiny", seed=1)
    first = models.transformers(hf, tokenizer)
    assert first.dtype == torch.float32 and models.transformers(hf, tokenizer) is first
    half = models.transformers(hf, tokenizer, dtype=torch.bfloat16)
    assert half is not first and half.dtype == torch.bfloat16
    assert models.transformers(hf, tokenizer) is half
    assert isinstance(continuous(generate.text(half))("Alice", max_tokens=2).value, str)
