"""Choice scores: every option's log-probability after the prompt, exact against a direct HF computation."""

import enum
import math
from typing import Literal

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from continuous import continuous, generate, samplers
from continuous.layout import interior_holes
from continuous.scores import option_tokens

OPTIONS = ["yes", "no", "yesterday", "maybe so", "Paris", "Par"]  # multi-token, shared prefixes


def direct(hf_model, tokenizer, prompt_ids: list[int], option: str) -> float:
    """The option's summed log-softmax after ``prompt_ids``, from one unpadded HF forward."""
    ids = tokenizer(option, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt_ids + ids])).logits[0].float()
    logp = logits.log_softmax(-1)
    return sum(logp[len(prompt_ids) - 1 + j, t].item() for j, t in enumerate(ids))


def prompt_ids(tokenizer, prompt: str) -> list[int]:
    return tokenizer(prompt)["input_ids"]


def test_scores_equal_the_direct_computation_for_a_batch(model, hf_model, tokenizer):
    prompts = ["Is it raining? Answer: ", "User: Tell me about Rosa.\nAssistant: She lives in "]
    state = continuous(generate.choice(model, OPTIONS, scores=True))(prompts)
    assert len(state.choice_scores) == 2
    for prompt, scores in zip(prompts, state.choice_scores):
        assert list(scores) == OPTIONS
        for option in OPTIONS:
            assert scores[option] == pytest.approx(direct(hf_model, tokenizer, prompt_ids(tokenizer, prompt), option),
                                                   abs=1e-4)


def test_mean_divides_by_the_token_count(model, tokenizer):
    prompt = "Is it raining? Answer: "
    summed = continuous(generate.choice(model, OPTIONS, scores=True))(prompt).choice_scores[0]
    mean = continuous(generate.choice(model, OPTIONS, scores="mean"))(prompt).choice_scores[0]
    for option in OPTIONS:
        count = len(tokenizer(option, add_special_tokens=False)["input_ids"])
        assert mean[option] == pytest.approx(summed[option] / count, abs=1e-5)
    assert len(tokenizer("maybe so", add_special_tokens=False)["input_ids"]) > 1  # the division shows


@pytest.mark.parametrize("options", [dict(), dict(seed=3, temperature=1.0)], ids=["greedy", "sampled"])
def test_the_chosen_option_is_the_same_as_without_scores(model, options):
    prompts = ["Q: pick one. A: ", "Choose: "]
    plain = continuous(generate.choice(model, OPTIONS))(prompts, **options)
    scored = continuous(generate.choice(model, OPTIONS, scores=True))(prompts, **options)
    assert scored.value == plain.value
    assert torch.equal(scored.token_ids, plain.token_ids)
    assert torch.equal(scored.weights, plain.weights)
    assert plain.choice_scores is None


def test_the_prompt_is_forwarded_once_and_the_options_in_one_batched_forward(model, tokenizer):
    prompts = ["Q: pick one. A: ", "Choose wisely: "]
    stats = model.stats
    plain_gen, scored_gen = (continuous(generate.choice(model, OPTIONS, scores=s)) for s in (False, True))
    before = stats.snapshot()
    plain = plain_gen(prompts)
    plain_cost = {k: v - before[k] for k, v in stats.snapshot().items()}
    before = stats.snapshot()
    scored_gen(prompts)
    scored_cost = {k: v - before[k] for k, v in stats.snapshot().items()}
    # Each option's tokens but its last go through the model once per prompt; nothing else more.
    extra = sum(len(option_tokens(tokenizer, p, o)) - 1 for p in prompts for o in OPTIONS)
    assert scored_cost["tokens_forwarded"] - plain_cost["tokens_forwarded"] == extra
    assert scored_cost["forward_calls"] - plain_cost["forward_calls"] == 1
    assert plain.value is not None


def test_single_token_options_cost_no_forward(model, tokenizer):
    options = ["a", "b", "c"]
    assert all(len(tokenizer(o, add_special_tokens=False)["input_ids"]) == 1 for o in options)
    gen = continuous(generate.choice(model, options, scores=True))
    before = model.stats.snapshot()
    state = gen("Letter: ", max_tokens=0)  # no generation: only the prompt's own forward
    assert model.stats.forward_calls - before["forward_calls"] == 1
    scores = state.choice_scores[0]
    assert all(v < 0 for v in scores.values()) and sum(math.exp(v) for v in scores.values()) < 1


def test_a_continued_state_recomputes_nothing_and_scores_after_its_text(model, hf_model, tokenizer):
    text = continuous(generate.text(model))
    state = text("User: Tell me about Rosa.\nAssistant:", max_tokens=5) + " Answer: "
    ids = state.token_ids[0][state.attention_mask[0].bool()].tolist()
    gen = continuous(generate.choice(model, OPTIONS, scores=True))
    before = model.stats.tokens_forwarded
    scored = gen(state, max_tokens=0)
    new = len(ids) - int(state.cached_lengths[0])  # the appended text (and the token whose logits it lacks)
    extra = sum(len(option_tokens(tokenizer, str(state), o)) - 1 for o in OPTIONS)
    assert model.stats.tokens_forwarded - before == new + extra
    for option in OPTIONS:
        assert scored.choice_scores[0][option] == pytest.approx(direct(hf_model, tokenizer, ids, option), abs=1e-4)


def test_a_batch_state_with_holes_scores_each_row_after_its_own_text(model, hf_model, tokenizer):
    text = continuous(generate.text(model))
    grown = text(["Once upon", "User: Tell me about Rosa and her cat.\nAssistant:"], max_tokens=6)
    state = grown[:, :24] + [" Answer:", " So:"]  # rows cut at different tokens: holes in the cache
    assert interior_holes(state.attention_mask)
    scored = continuous(generate.choice(model, OPTIONS, scores=True))(state, max_tokens=0)
    for r in range(2):
        ids = state.token_ids[r][state.attention_mask[r].bool()].tolist()
        for option in OPTIONS:
            assert scored.choice_scores[r][option] == pytest.approx(direct(hf_model, tokenizer, ids, option), abs=1e-4)


def test_a_prompt_from_the_prefix_cache_scores_the_same(hf_model, tokenizer):
    from continuous import models

    cached = models.transformers(hf_model, tokenizer, prefix_cache="50MB")
    prompt = "User: Tell me about Rosa and her cat.\nAssistant: The answer is"
    gen = continuous(generate.choice(cached, OPTIONS, scores=True))
    first = gen(prompt)
    before = cached.stats.tokens_cached
    again = gen(prompt + " surely")  # starts with the first call's tokens: they come from the cache
    assert cached.stats.tokens_cached > before
    ids = prompt_ids(tokenizer, prompt + " surely")
    for option in OPTIONS:
        assert again.choice_scores[0][option] == pytest.approx(direct(hf_model, tokenizer, ids, option), abs=1e-4)
    assert first.choice_scores != again.choice_scores


def test_concurrent_calls_score_as_calls_alone(model):
    from concurrent.futures import ThreadPoolExecutor

    gen = continuous(generate.choice(model, OPTIONS, scores=True))
    prompts = ["Pick: ", "User: Tell me about Rosa.\nAssistant:", "Choose one, quickly: "]
    alone = [gen(p) for p in prompts]
    with ThreadPoolExecutor(3) as pool:
        together = list(pool.map(gen, prompts))
    for a, t in zip(alone, together):
        assert t.value == a.value
        for option in OPTIONS:
            assert t.choice_scores[0][option] == pytest.approx(a.choice_scores[0][option], abs=1e-4)


def test_samples_of_a_prompt_share_its_scores(model):
    gen = continuous(generate.choice(model, OPTIONS, samplers.multinomial(3), scores=True))
    state = gen(["Pick: ", "Choose one: "], seed=1)
    scores = state.choice_scores
    assert len(scores) == 6
    assert scores[0] == scores[1] == scores[2] and scores[3] == scores[4] == scores[5]
    assert scores[0] != scores[3]
    # Selecting rows keeps their scores; a later call of another generator has none.
    assert state[1, 2, :].choice_scores == [scores[5]]
    assert continuous(generate.text(model))(state[0, 0, :], max_tokens=2).choice_scores is None


class Color(enum.Enum):
    RED = "red"
    GREEN = "green"
    BLUE = "blue"


def test_scores_are_keyed_like_value(model):
    state = continuous(generate.choice(model, Color, scores=True))("Color: ")
    assert set(state.choice_scores[0]) == set(Color)
    assert state.value in state.choice_scores[0]
    literal = continuous(generate.choice(model, Literal["up", "down"], scores=True))("Way: ")
    assert set(literal.choice_scores[0]) == {"up", "down"}


def test_the_options_follow_the_prompt_as_the_tokenizer_spells_them(tokenizer):
    # The prompt's last token never merges with the option: the option starts a new token.
    assert option_tokens(tokenizer, "Answer:", " yes") == tokenizer(" yes", add_special_tokens=False)["input_ids"]
    assert option_tokens(tokenizer, "Answer: ", "yes") == tokenizer("yes", add_special_tokens=False)["input_ids"]


def test_bad_scores_arguments_fail_clearly(model):
    with pytest.raises(ValueError, match="scores must be"):
        generate.choice(model, OPTIONS, scores="max")
    with pytest.raises(ValueError, match="non-empty"):
        generate.choice(model, ["", "a"], scores=True)
    with pytest.raises(ValueError, match="think="):
        generate.choice(model, OPTIONS, scores=True, think=8)
    gen = continuous(generate.choice(model, OPTIONS, scores=True))
    with pytest.raises(ValueError, match="heal"):
        gen("Answer:", heal=True)
    before = model.stats.snapshot()
    with pytest.raises(ValueError, match="context"):
        gen("word " * 600)
    assert model.stats.snapshot() == before  # refused before any compute


_WORDS = ["yes", "no", "ye", "Paris", "Pa", "maybe", " so", "13", "ok!", "é"]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(options=st.lists(st.lists(st.sampled_from(_WORDS), min_size=1, max_size=3).map("".join), min_size=1,
                        max_size=5, unique=True),
       prompts=st.lists(st.sampled_from(["Q: ", "Answer", "Tell me about Rosa.\n", "x"]), min_size=1, max_size=3))
def test_scores_equal_the_direct_computation_for_any_options(model, hf_model, tokenizer, options, prompts):
    state = continuous(generate.choice(model, options, scores=True))(prompts, max_tokens=0)
    for prompt, scores in zip(prompts, state.choice_scores):
        ids = prompt_ids(tokenizer, prompt)
        for option in options:
            reference = direct(hf_model, tokenizer, ids, option)
            assert option_tokens(tokenizer, prompt, option) == tokenizer(option, add_special_tokens=False)["input_ids"]
            assert scores[option] == pytest.approx(reference, abs=1e-4)


@pytest.mark.slow
@pytest.mark.real
def test_scores_are_exact_on_smollm2():
    from support.real import smollm2
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from continuous import chat, models

    path = smollm2()
    hf, tok = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), AutoTokenizer.from_pretrained(path)
    model = models.transformers(hf, tok)
    options = ["Paris", "Lyon", "Marseille", "Par", "London, England"]
    prompts = [chat.prompt(model, [{"role": "user", "content": "What is the capital of France? One word."}]),
               "The capital of France is"]
    state = continuous(generate.choice(model, options, scores=True))(prompts)
    for prompt, scores in zip(prompts, state.choice_scores):
        ids = tok(prompt)["input_ids"]
        for option in options:
            assert scores[option] == pytest.approx(direct(hf, tok, ids, option), abs=2e-3)
    assert max(state.choice_scores[0], key=state.choice_scores[0].get) == "Paris"
