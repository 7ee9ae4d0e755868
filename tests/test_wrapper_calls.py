"""Per-call options of continuous(): samplers, repetition penalty, transformers processors, log-probs."""

import math

import pytest
import torch
from support.models import hf_greedy
from transformers import LogitsProcessor, SuppressTokensLogitsProcessor

from continuous import continuous, generate, samplers


@pytest.fixture(scope="module")
def gen(model):
    return continuous(generate.text(model))


def ids_of(state, row=0):
    return state.token_ids[row][state.attention_mask[row].bool()].tolist()


def test_shorthand_is_a_multinomial_sampler_for_this_call_only(gen):
    short = gen("Once upon", max_tokens=12, seed=5, temperature=0.7, top_k=50)
    full = gen("Once upon", max_tokens=12, seed=5, sampler=samplers.multinomial(temperature=0.7, top_k=50))
    assert str(short) == str(full)
    assert isinstance(gen.generator.sampler, samplers.Greedy)  # the generator keeps its own
    assert str(gen("Once upon", max_tokens=12, temperature=0)) == str(gen("Once upon", max_tokens=12))


def test_min_p_one_keeps_only_the_likeliest_token(gen):
    greedy = gen("The cat", max_tokens=10)
    assert str(gen("The cat", max_tokens=10, seed=1, min_p=1.0)) == str(greedy)


def test_min_p_drops_tokens_below_its_share_of_the_likeliest():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    kept = samplers.multinomial(min_p=0.25).process(probs.log())
    assert torch.isfinite(kept).tolist() == [[True, True, True, False]]


@pytest.mark.parametrize("bad", [dict(min_p=1.5), dict(min_p=-0.1)])
def test_bad_min_p_is_refused(bad):
    with pytest.raises(ValueError, match="min_p"):
        samplers.multinomial(**bad)


def test_sampler_and_shorthand_together_are_refused(gen):
    with pytest.raises(ValueError, match="not both"):
        gen("a", sampler=samplers.greedy(), temperature=0.5)
    with pytest.raises(TypeError, match="sampler"):
        gen("a", sampler="greedy")


def test_repetition_penalty_matches_transformers_generate(hf_model, gen):
    state = gen("the the the cat sat on the", max_tokens=16, repetition_penalty=0.05)
    prompt_ids = ids_of(gen("the the the cat sat on the", max_tokens=0))
    expected = hf_greedy(hf_model, prompt_ids, 16, repetition_penalty=0.05)
    assert ids_of(state)[len(prompt_ids):] == expected[: len(ids_of(state)) - len(prompt_ids)]
    assert ids_of(state) != ids_of(gen("the the the cat sat on the", max_tokens=16))


def test_transformers_processors_run_unchanged(model, gen):
    free = gen("Once upon a time", max_tokens=8)
    banned = ids_of(free)[-8:][:3]
    state = gen("Once upon a time", max_tokens=8, logits_processors=[SuppressTokensLogitsProcessor(banned)])
    assert not set(ids_of(state)[-8:]) & set(banned)


def test_processors_see_every_row_s_tokens_left_padded(model, gen):
    seen = []

    class Record(LogitsProcessor):
        def __call__(self, input_ids, scores):
            seen.append(input_ids.clone())
            return scores

    state = gen(["a b", "a much longer prompt here"], max_tokens=3, logits_processors=[Record()])
    pad = state._rows.pad
    last = seen[-1].tolist()  # the last step's, before its token was chosen
    for r in range(2):
        before = ids_of(state, r)[:-1]
        assert last[r][len(last[r]) - len(before):] == before
        assert set(last[r][: len(last[r]) - len(before)]) <= {pad}
    assert seen[0].shape[1] < seen[-1].shape[1]


def test_a_processor_that_fails_leaves_the_input_usable(gen):
    state = gen("Hello", max_tokens=2)

    def broken(input_ids, scores):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        gen(state, max_tokens=3, logits_processors=[broken])
    assert str(gen(state, max_tokens=3)) == str(gen(gen("Hello", max_tokens=2), max_tokens=3))


def test_logprobs_are_consistent_with_weights_and_text(gen):
    state = gen("Once upon", max_tokens=10, seed=2, temperature=0.9, logprobs=3)
    (row,) = state.logprobs
    assert len(row) == 10
    assert math.isclose(sum(lp for _, lp, _ in row), float(state.weights[0, 0]), rel_tol=1e-4, abs_tol=1e-4)
    tokenizer = gen.model.tokenizer
    assert [text for text, _, _ in row] == [tokenizer.decode([t]) for t in ids_of(state)[-10:]]
    for text, lp, alts in row:
        assert len(alts) == 3
        assert [a for _, a in alts] == sorted((a for _, a in alts), reverse=True)
        assert lp <= alts[0][1] + 1e-6


def test_greedy_logprobs_take_the_top_alternative(gen):
    state = gen("The dog", max_tokens=6, logprobs=2)
    for text, lp, alts in state.logprobs[0]:
        assert alts[0][0] == text and math.isclose(alts[0][1], lp, abs_tol=1e-6)


def test_forced_tokens_have_log_probability_zero(model):
    gen = continuous(generate.choice(model, ["a long answer here", "b"]))
    state = gen("Q:", logprobs=1)
    row = state.logprobs[0]
    forced = row[1:] if state.value == "a long answer here" else []
    assert all(lp == 0.0 for _, lp, _ in forced)
    assert math.isclose(sum(lp for _, lp, _ in row), float(state.weights[0, 0]), abs_tol=1e-5)


def test_no_logprobs_unless_asked_and_rows_select_theirs(gen):
    assert gen("a", max_tokens=2).logprobs is None
    batch = gen(["one", "two words"], max_tokens=3, logprobs=0)
    assert [len(r) for r in batch.logprobs] == [3, 3]
    assert batch[1, :].logprobs == [batch.logprobs[1]]
    with pytest.raises(ValueError, match="logprobs"):
        gen("a", logprobs=-1)


def test_arguments_by_position_or_by_name_are_the_same_call(model):
    gen = continuous(generate.text(model))
    by_name = gen("Once upon", max_tokens=4, stop_at="\n")
    assert str(gen("Once upon", 4, "\n")) == str(by_name)
    with pytest.raises(TypeError, match="max_tokenz"):
        gen("Once upon", max_tokenz=4)
    with pytest.raises(TypeError):
        gen("Once upon", 4, max_tokens=4)  # given twice
