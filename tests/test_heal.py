"""Token healing on real tokenizers: prompts that end mid-word or mid-URL."""

import re

import pytest
import torch
from support.models import build_arch
from support.states import real_ids

from continuous import continuous, generate, models
from continuous.heal import HealMatcher, heal_length, token_strings

PROMPTS = ["Visit https://www.exa", "The quick bro", "Il était une foi", "Le café est cha"]


# Llama 3's vocabulary is byte-level BPE and big, as Qwen2's is: the fast tier keeps one of them.
@pytest.fixture(scope="module", params=[pytest.param("llama", marks=pytest.mark.slow), "mistral", "qwen2", "phi3"])
def model(request):
    hf, tok = build_arch(request.param)
    return models.transformers(hf, tok)


def test_healed_text_starts_with_the_prompt_and_its_first_token_is_canonical(model):
    tok = model.tokenizer
    strings = token_strings(tok)
    gen = continuous(generate.text(model))
    healed = 0
    for prompt in PROMPTS:
        base = gen(prompt, max_tokens=0)  # prefilled: healing crops this state's cache
        before = model.stats.tokens_forwarded
        out = gen(base, max_tokens=4, heal=True)
        assert str(out).startswith(prompt)
        old, ids = real_ids(base), real_ids(out)
        ends = list(base._rows.ends[0])
        k = heal_length(strings, prompt, ends, first=sum(e == 0 for e in ends))
        if not k:
            assert ids[: len(old)] == old and str(out) == prompt + out.value
            continue
        healed += 1
        cut = ends[-k - 1]
        removed, first = prompt[cut:], ids[len(old) - k]
        assert ids[: len(old) - k] == old[: len(old) - k]  # the kept tokens, then the healed ones
        assert strings.text[first].startswith(removed)  # the first token spells the removed text again
        assert str(out) == prompt[:cut] + strings.text[first] + str(out)[cut + len(strings.text[first]):]
        assert out.value == str(out)[len(prompt):]  # the value leaves the re-spelled text out
        # Canonical: the kept text's last tokens then the first token encode as them, then it.
        kept = ends[:-k]
        window = prompt[kept[-4] if len(kept) >= 4 else 0 : cut]
        assert tok(window + strings.text[first], add_special_tokens=False).input_ids == \
            tok(window, add_special_tokens=False).input_ids + [first]
        # The crop kept the cache: the last kept token comes back for its logits, then 3 new ones.
        assert model.stats.tokens_forwarded - before == 1 + 3
    assert healed >= 2


def test_healing_composes_with_a_constraint(model):
    gen = continuous(generate.regex(model, r"[a-z]{2,8}\.com"))
    out = gen("Visit https://www.exa", heal=True)
    assert str(out).startswith("Visit https://www.exa")
    assert re.fullmatch(r"[a-z]{2,8}\.com", out.value)
    assert str(out).endswith(out.value)


def test_no_healing_by_default(model):
    gen = continuous(generate.text(model))
    base = gen("Visit https://www.exa", max_tokens=0)
    out = gen(base, max_tokens=2)
    assert real_ids(out)[: len(real_ids(base))] == real_ids(base)


def test_heal_length_and_matcher_rollback(model):
    tok = model.tokenizer
    strings = token_strings(tok)
    text = "Visit https://www.exa"
    enc = tok(text, return_offsets_mapping=True)
    ends = [e for _, e in enc["offset_mapping"]]
    k = heal_length(strings, text, ends, first=1 if ends[0] == 0 else 0)
    assert 1 <= k <= 3
    removed = text[ends[-k - 1]:]
    m = HealMatcher(removed, None, strings, tok, len(tok), tok.eos_token_id, text[: ends[-k - 1]])
    first = sorted(m.first)[0]
    mask = torch.zeros((len(tok) + 31) // 32, dtype=torch.int32)
    m.fill(mask)
    before = mask.clone()
    copy = m.copy()
    m.advance(first)
    assert m.remaining == ""
    m.rollback(1)
    m.fill(mask)
    assert torch.equal(mask, before)
    assert copy.remaining == removed


def test_healing_with_no_token_to_generate_keeps_the_text(model):
    gen = continuous(generate.text(model))
    out = gen("Visit https://www.exa", max_tokens=0, heal=True)
    assert str(out) == "Visit https://www.exa" and out.value == ""


def test_stop_strings_and_bans_do_not_match_the_healed_text(model):
    prompt = "Visit https://www.exa"
    out = continuous(generate.text(model))(prompt, max_tokens=4, heal=True, stop_at=["exa", "www.e"])
    assert str(out).startswith(prompt) and "exa" not in out.value
    banned = continuous(generate.text(model, ban=["exa", "w.ex"]))(prompt, max_tokens=4, heal=True)
    assert str(banned).startswith(prompt)


# No BOS: the prompt's token is the row's only one.
@pytest.mark.parametrize("arch", [pytest.param("llama", marks=pytest.mark.slow), "qwen2", "gpt2"])
def test_a_one_token_prompt_without_bos_is_not_healed_away(arch):
    hf, tok = build_arch(arch)
    model = models.transformers(hf, tok)
    prompt = "The"  # one token, which longer tokens extend
    assert len(tok(prompt).input_ids) == 1
    out = continuous(generate.text(model))(prompt, max_tokens=2, heal=True)
    assert str(out).startswith(prompt)
