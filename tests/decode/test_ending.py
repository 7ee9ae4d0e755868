"""How rows end: reasons, rows left with no token, stop strings against constraints, each row's room."""

import math
import warnings

import pytest
import torch

from continuous import BanExhausted, ContextWarning, continuous, generate, models, samplers


def forbid_all(input_ids, scores):
    return torch.full_like(scores, -math.inf)


def _quiet(call):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = call()
    return state, [w for w in caught if issubclass(w.category, BanExhausted)]


@pytest.mark.parametrize("sampler", [samplers.greedy(), samplers.multinomial()])
def test_processors_that_leave_no_token_end_the_row_with_a_reason_and_a_warning(model, sampler):
    gen = continuous(generate.text(model, sampler))
    state, warned = _quiet(lambda: gen("Hello", max_tokens=5, seed=1, logits_processors=[forbid_all]))
    assert state.finish_reasons == ["ban_exhausted"] and str(state) == "Hello"
    assert state.value == "" and float(state.weights[0, 0]) == 0.0
    assert warned and "logits processors" in str(warned[0].message)


def test_sampling_a_relaxed_schema_that_no_document_satisfies_ends_exhausted(model):
    schema = {"type": "array", "items": {"enum": [1, 2]}, "minItems": 3, "uniqueItems": True}
    gen = continuous(generate.json(model, schema, samplers.multinomial()))
    state, warned = _quiet(lambda: gen("Array:", seed=0, max_tokens=40))
    assert warned and state.finish_reasons == ["ban_exhausted"]
    assert math.isfinite(float(state.weights[0, 0]))


def test_a_row_banned_out_at_its_first_position_weighs_nothing(model):
    gen = continuous(generate.choice(model, ["Rome"], ban=["Rome"]))
    state, warned = _quiet(lambda: gen("City:"))
    assert warned and state.finish_reasons == ["ban_exhausted"] and str(state) == "City:"
    assert float(state.weights[0, 0]) == 0.0  # it kept no token: not NaN


def test_a_stop_string_that_ends_a_whole_match_leaves_the_match_whole(model):
    state = continuous(generate.choice(model, ["Nice to meet you"]))("Say:", stop_at="you")
    assert state.value == "Nice to meet you" and state.finish_reasons == ["stop"]
    schema = {"type": "object", "properties": {"a": {"type": "integer", "maximum": 9}}, "required": ["a"],
              "additionalProperties": False}
    state = continuous(generate.json(model, schema))("JSON:", stop_at="}")
    assert set(state.value) == {"a"} and str(state).endswith("}")


def test_a_stop_string_inside_a_match_cuts_it_short(model):
    state = continuous(generate.choice(model, ["Nice to meet you"]))("Say:", stop_at="meet")
    assert state.finish_reasons == ["stop"] and str(state).endswith("meet")
    with pytest.raises(ValueError, match="stop string"):
        state.value


def test_a_stop_string_on_the_last_allowed_token_is_a_stop(model):
    gen = continuous(generate.text(model))
    checked = 0
    for prompt in ["Story:", "Once", "The cat", "Numbers:"]:
        five, six = (str(gen(prompt, max_tokens=n))[len(prompt):] for n in (5, 6))
        last = six[len(five):]  # the sixth token's text
        if last and six.find(last) == len(six) - len(last):
            state = gen(prompt, max_tokens=6, stop_at=last)
            assert state.finish_reasons == ["stop"] and str(state) == prompt + six
            checked += 1
    assert checked


def test_each_row_s_room_is_its_own(tokenizer):
    from support.models import build_llama

    hf = build_llama(tokenizer, "tiny", seed=0, max_position_embeddings=64)
    model = models.transformers(hf, tokenizer)
    gen = continuous(generate.text(model, ban=None))
    long = tokenizer.decode(tokenizer(" ".join(["word"] * 40)).input_ids[:50], skip_special_tokens=True)
    n_long = len(tokenizer(long).input_ids)
    assert 34 < n_long < 64  # the long row runs out of context before 30 tokens
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ContextWarning)
        batch = gen(["Hi", long], max_tokens=30)
    alone = gen("Hi", max_tokens=30)
    assert batch.finish_reasons[0] == alone.finish_reasons[0] == "length"
    assert str(batch[0, :]) == str(alone)
    assert batch.finish_reasons[1] == "context"
