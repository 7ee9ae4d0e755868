"""continuous(): prompts, batches, stopping, streaming, forking, outlines generators, bad input."""

import pytest
import torch

from continuous import (
    SampleMismatch,
    SampleMismatchError,
    continuous,
    generate,
    samplers,
)


@pytest.fixture(scope="module")
def gen(model):
    return continuous(generate.text(model))


def test_conversation_forwards_only_new_tokens(model, gen):
    """5 turns: each forwards its new text and the previous turn's last token, nothing else."""
    state = gen("System: be brief.\nUser: hi\nAssistant:", max_tokens=8)
    for turn in range(4):
        before = model.stats.tokens_forwarded
        prompt = state + f"\nUser: question {turn}?\nAssistant:"
        new = int(prompt.attention_mask[0, prompt._rows.cache_length:].sum())
        state = gen(prompt, max_tokens=8)
        generated = len(state._rows.real_ids(0)) - len(prompt._rows.real_ids(0))
        assert model.stats.tokens_forwarded - before == new + generated - 1
        assert int(state.cached_lengths[0]) == len(state._rows.real_ids(0)) - 1


def test_batch_rows_finish_at_different_steps(model):
    gen = continuous(generate.choice(model, ["a", "a longer answer", "mid answer"]))
    state = gen(["Q:", "Another question:", "x"])
    assert all(v in ("a", "a longer answer", "mid answer") for v in state.value)
    for r, text in enumerate(state):
        assert text.endswith(state.value[r])
    # continuing a state whose rows ended at different steps needs no recompute of old tokens
    before = model.stats.tokens_forwarded
    again = continuous(generate.text(model))(state, max_tokens=1)
    uncached = int((state.attention_mask.sum(1) - state.cached_lengths).sum())
    assert uncached > 0  # each row's last step (forced tokens included) was not forwarded
    assert model.stats.tokens_forwarded - before == uncached
    assert list(again) == list(continuous(generate.text(model))(state.drop_cache(), max_tokens=1))


def test_prompts_of_different_lengths_match_alone(gen):
    prompts = ["Alice", "Order #1042: 3 x lamp shipped to Oslo on 2024-01-02", "Bob is"]
    batched = gen(prompts, max_tokens=6)
    for r, p in enumerate(prompts):
        assert list(batched)[r] == str(gen(p, max_tokens=6))


def test_stop_at(model, gen):
    free = str(gen("Alice", max_tokens=12))[len("Alice"):]
    stop = free[3:5]
    state = gen("Alice", max_tokens=12, stop_at=[stop, "never-there"])
    assert state.value == free[: free.index(stop)]
    assert str(state) == "Alice" + free[: free.index(stop) + len(stop)]
    assert gen("Alice", max_tokens=12, stop_at=stop).value == state.value


def test_max_tokens(model, gen):
    state = gen(["a", "b"], max_tokens=3)
    assert all(len(state._rows.real_ids(r)) - 2 <= 3 for r in range(2))
    zero = gen("abc", max_tokens=0)
    assert str(zero) == "abc" and zero.value == ""


def test_stream_yields_the_generated_text(model, gen):
    pieces = []
    stream = gen.stream(["Alice", "Bob is"], max_tokens=5)
    while True:
        try:
            pieces.append(next(stream))
        except StopIteration as done:
            final = done.value
            break
    assert len(pieces) == 5 and all(len(p) == 2 for p in pieces)
    for r in range(2):
        assert "".join(p[r] for p in pieces) == final.value[r]
    single = list(gen.stream("Alice", max_tokens=4))
    assert all(isinstance(p, str) for p in single)
    assert "".join(single) == gen("Alice", max_tokens=4).value


def test_fork_computes_the_prefix_once(model):
    prompt = "Order #1042: 3 x lamp shipped to Oslo"
    n_prompt = len(model.tokenizer(prompt).input_ids)
    gen = continuous(generate.text(model, samplers.multinomial(4)))
    before = model.stats.tokens_forwarded
    state = gen(prompt, max_tokens=5, seed=0)
    assert (state.batch_size, state.num_samples) == (1, 4)
    # The prompt once, then each row's tokens but a last one that no step needed to forward.
    new = [len(state._rows.real_ids(r)) - n_prompt for r in range(4)]
    last = [why == "length" for why in state.finish_reasons]
    assert model.stats.tokens_forwarded - before == n_prompt + sum(new) - sum(last)
    # a one-sample state forks too; a 4-sample state continues as it is
    base = continuous(generate.text(model))(prompt, max_tokens=2)
    assert gen(base, max_tokens=2, seed=1).num_samples == 4
    assert gen(state, max_tokens=2, seed=1).num_samples == 4


def test_seed_and_rng_make_sampling_reproducible(model):
    gen = continuous(generate.text(model, samplers.multinomial(2, temperature=1.5)))
    a = gen("Alice", max_tokens=8, seed=7)
    b = gen("Alice", max_tokens=8, seed=7)
    c = gen("Alice", max_tokens=8, rng=torch.Generator().manual_seed(7))
    assert list(a) == list(b) == list(c)
    assert torch.equal(a.weights, b.weights)


def test_beam_search_keeps_beams_across_calls(model, hf_model):
    gen = continuous(generate.text(model, samplers.beam_search(3)))
    state = gen("Alice", max_tokens=4)
    assert state.num_samples == 3
    assert len(set(state)) == 3  # forked beams pick distinct tokens
    w = state.weights[0]
    assert torch.all(w[:-1] >= w[1:])  # best first
    more = gen(state + " and", max_tokens=3)
    assert more.num_samples == 3
    # Each beam's weight is exactly its ancestor's plus the log-probabilities of the
    # tokens it generated (appended text adds none), scored here by the model itself.
    prompt = state + " and"
    for r, text in enumerate(more):
        ancestor = next(a for a, t in enumerate(prompt) if text.startswith(t))
        ids = more._rows.real_ids(r)
        start = len(prompt._rows.real_ids(ancestor))
        with torch.no_grad():
            logprobs = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].double(), -1)
        gained = sum(float(logprobs[i - 1, ids[i]]) for i in range(start, len(ids)))
        assert float(more.weights[0, r]) == pytest.approx(float(state.weights[0, ancestor]) + gained, abs=1e-3)


def test_sample_mismatch_names_both_counts(model):
    three = continuous(generate.text(model, samplers.multinomial(3)))("x", max_tokens=1, seed=0)
    with pytest.raises(SampleMismatch, match=r"3 .* 2|2 .* 3"):
        continuous(generate.text(model, samplers.multinomial(2)))(three)
    assert SampleMismatchError is SampleMismatch


def test_bad_input(model, gen):
    with pytest.raises(TypeError):
        gen(42)
    with pytest.raises(TypeError):
        gen(["a", 3])
    with pytest.raises(ValueError):
        gen([])
    with pytest.raises(ValueError):
        gen("a", max_tokens=-1)
    with pytest.raises(TypeError):
        gen("a", stop_at=3)
    with pytest.raises(ValueError):
        gen("a", seed=1, rng=torch.Generator())


def test_too_long_prompt_fails_before_any_compute(model, gen):
    state = gen("Alice is", max_tokens=2)
    long_text = " lamp" * (model.max_length + 10)
    before = model.stats.snapshot()
    with pytest.raises(ValueError, match="context"):
        gen(long_text)
    with pytest.raises(ValueError, match="context"):
        gen(state + long_text)
    assert model.stats.snapshot() == before
    # the input state is still usable after the failure
    assert list(gen(state, max_tokens=3)) == list(gen(state.drop_cache(), max_tokens=3))


def test_wrong_model_state(model, tokenizer):
    from support.models import build_llama

    from continuous import models

    other = continuous(generate.text(models.transformers(build_llama(tokenizer, seed=2), tokenizer)))
    state = continuous(generate.text(model))("x", max_tokens=1)
    with pytest.raises(ValueError, match="model"):
        other(state)


def test_wraps_outlines_generators(model, hf_model, tokenizer):
    import outlines
    from outlines.types import Regex

    om = outlines.from_transformers(hf_model, tokenizer)
    wrapped = continuous(outlines.Generator(om, Regex(r"[a-c]{3}")))
    state = wrapped("Letters:")
    assert len(state.value) == 3 and set(state.value) <= set("abc")
    assert wrapped.model is model  # the same backend and stats for the same HF model
    more = wrapped(state + " more:")
    assert more.kv_cache is not None and set(more.value) <= set("abc")
    free = continuous(outlines.Generator(om))
    assert isinstance(free("Alice", max_tokens=3).value, str)


def test_stream_checks_its_arguments_when_called(gen):
    with pytest.raises(TypeError):
        gen.stream(42)
    with pytest.raises(ValueError):
        gen.stream("a", max_tokens=-2)


# ---------------------------------------------------------------- arguments checked when a call starts
@pytest.fixture(scope="module")
def demo():
    from continuous import models
    from continuous.assets import DEMO_MODEL

    return models.transformers(DEMO_MODEL, dtype=torch.float32)


@pytest.mark.parametrize("seeds", [(25, 18), tuple(range(274, 280)), tuple(range(322, 328))])
def test_text_is_the_decode_of_its_ids_one_token_per_call(demo, seeds):
    # Random tokens (temperature 1e6) often split a character between two calls; the
    # text must stay the decode of the ids (it once repeated the whole context).
    gen = continuous(generate.text(demo, samplers.multinomial(temperature=1e6)))
    state = gen("User: Hi\nAssistant:", max_tokens=0)
    for seed in seeds:
        state = gen(state, max_tokens=1, seed=seed)
        ids = state._rows.real_ids(0)[1:]  # the prompt's text leaves out the BOS it was given
        # Generated special tokens are text like any other.
        assert str(state) == demo.tokenizer.decode(ids, skip_special_tokens=False,
                                                   clean_up_tokenization_spaces=False)
