"""Speculation: drafters, the acceptance rules, and calls that give what they give without it."""

import collections
import math
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, Field
from support.models import build_llama
from support.states import real_ids

from continuous import PromptLookup, continuous, generate, models, samplers
from continuous.decode.speculate import DraftModel, draw, greedy_accepted, residual, sampled_accepted

WS = ""  # no free whitespace: a random model would otherwise wander in it


class Item(BaseModel):
    name: str = Field(max_length=8)
    count: int = Field(ge=0, le=999)


@pytest.fixture(scope="module")
def other(tokenizer):
    """A draft model that disagrees with the test model most of the time."""
    return models.transformers(build_llama(tokenizer, "tiny", seed=1, max_position_embeddings=512), tokenizer)


# Prompt lookup


def test_prompt_lookup_proposes_what_followed_the_latest_match_of_the_longest_ngram():
    lookup = PromptLookup(k=3, ngram=3)
    assert lookup.propose([1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 2, 3]) == [7, 8, 5]  # 2,3 at its latest earlier place
    assert lookup.propose([4, 2, 3, 5, 6, 1, 2, 3, 7, 1, 2, 3]) == [7, 1, 2]  # 1,2,3 beats the later 2,3
    assert lookup.propose([1, 2, 3, 4]) == []  # 4 never occurred before
    assert lookup.propose([5, 6, 5], k=1) == [6]
    assert lookup.propose([5]) == [] and lookup.propose([]) == []
    with pytest.raises(ValueError, match="k must be"):
        PromptLookup(k=0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 4), max_size=30), st.integers(1, 4), st.integers(1, 5))
def test_prompt_lookup_copies_a_continuation_of_an_earlier_occurrence(ids, ngram, k):
    proposal = PromptLookup(k=k, ngram=ngram).propose(ids)
    n = len(ids)
    if n >= 2 and ids[-1] in ids[:-1]:
        assert proposal  # a repeated last token always finds something
    if not proposal:
        return
    assert len(proposal) <= k
    # Some n-gram ending the ids occurred at an earlier place followed by the proposal.
    found = [(size, start) for size in range(1, min(ngram, n - 1) + 1) for start in range(size, n)
             if ids[start - size : start] == ids[n - size :] and ids[start : start + len(proposal)] == proposal
             and (start + len(proposal) == n or len(proposal) == k)]
    assert found
    longest = max(size for size in range(1, min(ngram, n - 1) + 1)
                  if any(ids[s - size : s] == ids[n - size :] for s in range(size, n)))
    assert any(size == longest for size, _ in found)


# The acceptance rules


def test_greedy_acceptance_is_equality_with_the_argmax():
    scores = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0], [0.0, 0.0, 5.0]])
    assert greedy_accepted(scores, torch.tensor([1, 1])).tolist() == [True, False]
    assert greedy_accepted(scores, torch.tensor([1, 0, 2])).tolist() == [True, True, True]


@pytest.mark.parametrize("q", [None, [0.1, 0.6, 0.3]], ids=["point-mass", "draft-distribution"])
def test_the_rejection_rule_keeps_the_distribution(q):
    p = torch.tensor([[0.5, 0.3, 0.2]])
    rng = torch.Generator().manual_seed(0)
    n = 20000
    counts = collections.Counter()
    for _ in range(n):
        qd = None if q is None else torch.tensor([q])
        x = 1 if qd is None else draw(qd[0], rng)  # a deterministic drafter always proposes 1
        u = torch.rand(1, generator=rng, dtype=torch.float64)
        ok = sampled_accepted(p, qd, torch.tensor([x]), u)
        counts[x if ok.item() else residual(p[0], None if qd is None else qd[0], x, rng)] += 1
    chi2 = sum((counts[i] - n * p[0, i].item()) ** 2 / (n * p[0, i].item()) for i in range(3))
    assert chi2 < 13.8  # p = 0.001 with 2 degrees of freedom


def test_a_residual_never_draws_what_has_no_mass_left():
    rng = torch.Generator().manual_seed(0)
    p, q = torch.tensor([0.5, 0.5, 0.0]), torch.tensor([0.6, 0.2, 0.2])
    assert {residual(p, q, 0, rng) for _ in range(50)} == {1}
    assert {residual(p, None, 0, rng) for _ in range(50)} == {1}
    assert residual(torch.tensor([0.0, 1.0]), torch.tensor([0.0, 1.0]), 1, rng) == 1  # p == q: a draw from p


# Calls


def drafters(model, other=None):
    """Prompt lookup (some drafts kept), the model drafting for itself (all kept), another model (few kept)."""
    return [PromptLookup(k=4, ngram=2), DraftModel(model, k=3)] + ([DraftModel(other, k=2)] if other else [])


def same(a, b):
    assert list(a) == list(b)
    for r in range(a._rows.n_rows):
        assert real_ids(a, r) == real_ids(b, r)
    assert a.value == b.value
    assert torch.allclose(a.weights, b.weights, atol=1e-3)
    if a.constraint_cost is not None:
        assert a.constraint_cost == pytest.approx(b.constraint_cost, abs=1e-3)


KINDS = {
    "text": lambda m: generate.text(m),
    "choice": lambda m: generate.choice(m, ["the cat sat", "the cat ran", "a dog"]),
    "json": lambda m: generate.json(m, Item, whitespace_pattern=WS),
    "regex": lambda m: generate.regex(m, r"(ab|cd){2,6}-[0-9]{3}"),
    "cfg": lambda m: generate.cfg(m, 'start: "x" item ("," item)*\nitem: /[a-c]{1,3}/'),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_greedy_outputs_do_not_change(model, other, kind):
    gen = continuous(KINDS[kind](model))
    prompt = ["the cat sat the cat sat the cat", "abab cd abab cd -123 ab"]
    plain = gen(prompt, max_tokens=20)
    for drafter in drafters(model, other):
        model.stats.reset()
        state = gen(prompt, max_tokens=20, speculate=drafter)
        same(plain, state)
        assert model.stats.tokens_accepted <= model.stats.tokens_drafted


def test_a_draft_model_that_is_the_model_is_always_right(model):
    gen = continuous(generate.text(model))
    prompt = "one two three"
    plain = gen(prompt, max_tokens=24)
    other_hf = build_llama(model.tokenizer, "tiny", seed=0, max_position_embeddings=512)  # the same weights
    draft = models.transformers(other_hf, model.tokenizer)
    model.stats.reset()
    state = gen(prompt, max_tokens=24, speculate=DraftModel(draft, k=4))
    same(plain, state)
    assert model.stats.tokens_drafted > 0
    assert model.stats.tokens_accepted == model.stats.tokens_drafted
    assert model.stats.forward_calls <= 1 + math.ceil(24 / 5)  # the prefill, then k + 1 tokens a forward


GENERATORS = {
    "bans": lambda m, banned: continuous(generate.text(m, ban=banned)),
    "text-no-ff": lambda m, banned: continuous(generate.text(m), fast_forward=False),
    "json-no-ff-bans": lambda m, banned: continuous(generate.json(m, Item, whitespace_pattern=WS, ban=["9"]),
                                                    fast_forward=False),
}


@pytest.mark.parametrize("kind", ["text", "json"])
def test_a_row_keeps_no_slot_of_its_rejected_drafts(model, other, kind):
    """The slots of drafts no row kept are written over by the next step: a row's state, its
    cache included, is laid out as without speculation (a swarm session cannot squeeze holes out)."""
    gen = continuous(KINDS[kind](model))
    prompt = "the cat sat the cat sat the cat"
    plain = gen(prompt, max_tokens=24)
    model.stats.reset()
    state = gen(prompt, max_tokens=24, speculate=DraftModel(other, k=3))  # drafts at every step, mostly wrong
    same(plain, state)
    assert model.stats.tokens_drafted > model.stats.tokens_accepted
    assert torch.equal(state.attention_mask, plain.attention_mask)
    assert state._rows.cache.length == plain._rows.cache.length


@pytest.mark.parametrize("kind", list(GENERATORS))
def test_bans_stops_healing_and_no_fast_forward_see_only_kept_text(model, kind):
    prompt = "User: Tell me about Omar. Omar is Omar.\nAssistant:"
    free = continuous(generate.text(model))(prompt, max_tokens=16).value
    banned = [w for w in free.split() if len(w) >= 3][:2]
    assert banned
    gen = GENERATORS[kind](model, banned)
    for kwargs in ({}, {"stop_at": free[6:9]}, {"heal": True}, {"logprobs": 2}):
        plain = gen(prompt, max_tokens=16, **kwargs)
        for drafter in drafters(model):
            state = gen(prompt, max_tokens=16, speculate=drafter, **kwargs)
            same(plain, state)
            if "logprobs" in kwargs:
                mine, theirs = state.logprobs[0], plain.logprobs[0]
                assert [t for t, _, _ in mine] == [t for t, _, _ in theirs]
                assert [lp for _, lp, _ in mine] == pytest.approx([lp for _, lp, _ in theirs], abs=1e-3)
            if not kwargs:
                streamed = "".join(gen.stream(prompt, max_tokens=16, speculate=drafter))
                assert streamed == "".join(gen.stream(prompt, max_tokens=16))


def test_the_state_continues_and_slices_as_without_speculation(model):
    gen = continuous(generate.text(model))
    prompt = ["a b a b a b", "x y z x y z x"]
    plain = gen(prompt, max_tokens=16)
    state = gen(prompt, max_tokens=16, speculate=PromptLookup(k=4))
    same(plain, state)
    same(gen(plain, max_tokens=8), gen(state, max_tokens=8))
    same(gen(state, max_tokens=8), gen(state.drop_cache(), max_tokens=8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for key in (slice(0, 20), slice(3, 25)):
            cut = state[0, key]
            same(gen(cut, max_tokens=6), gen(cut.drop_cache(), max_tokens=6))


@pytest.mark.parametrize("kind", ["text", "json"])
def test_a_stream_closed_between_steps_leaves_a_state_that_goes_on_as_without_speculation(model, other, kind):
    """Between a step and its check, the state holds the row's own tokens only, not the drafts."""
    gen = continuous(KINDS[kind](model))
    prompt = "the cat sat the cat sat the cat"
    plain = gen(prompt, max_tokens=24)
    stream = gen.stream(prompt, max_tokens=24, speculate=DraftModel(other, k=3))  # drafts at every step, mostly wrong
    for _, _ in zip(range(3), stream):
        pass
    stream.close()
    cut = stream.state
    n = len(real_ids(cut)) - len(real_ids(gen(prompt, max_tokens=0)))
    assert 0 < n < 24
    assert real_ids(plain)[: len(real_ids(cut))] == real_ids(cut)
    rest, again = gen(cut, max_tokens=24 - n), gen(cut.drop_cache(), max_tokens=24 - n)
    assert real_ids(rest) == real_ids(again) and str(rest) == str(again)  # the cache holds no draft
    if kind == "text":  # (a constrained call starts its constraint anew)
        assert real_ids(rest) == real_ids(plain) and str(rest) == str(plain)


def test_sampling_keeps_the_distribution(model, tokenizer):
    """A few-token language: the outputs' histogram with drafts equals that without them."""
    gen = continuous(generate.regex(model, r"[ab]{4}", samplers.multinomial(400, temperature=2.0)))
    prompt = "abab baba aabb abba"

    def histogram(**kw):
        counts = collections.Counter()
        for seed in range(3):
            value = gen(prompt, seed=seed, **kw).value
            counts.update(value[0] if isinstance(value[0], list) else value)
        return counts

    plain = histogram()
    before = model.stats.snapshot()
    drafted = histogram(speculate=PromptLookup(k=4, ngram=2))
    assert model.stats.tokens_drafted > before["tokens_drafted"]
    assert model.stats.tokens_accepted > before["tokens_accepted"]  # both of the rule's branches ran
    keys = [k for k in set(plain) | set(drafted) if plain[k] + drafted[k] >= 10]
    n1, n2 = sum(plain.values()), sum(drafted.values())
    # Two-sample chi-square over the frequent outcomes.
    chi2 = sum((plain[k] / n1 - drafted[k] / n2) ** 2 / ((plain[k] + drafted[k]) / (n1 + n2)) for k in keys)
    chi2 *= n1 * n2 / (n1 + n2)
    assert chi2 < 2 * len(keys) + 10


def test_what_speculation_refuses(model, tokenizer):
    gen = continuous(generate.text(model))
    with pytest.raises(ValueError, match="beam search"):
        continuous(generate.text(model, samplers.beam_search(2)))("a", speculate=PromptLookup())
    with pytest.raises(ValueError, match="repetition_penalty"):
        gen("a", repetition_penalty=1.2, speculate=PromptLookup())
    with pytest.raises(TypeError, match="speculate= takes"):
        gen("a", speculate=3)
    from support.models import build_tokenizer
    small = build_tokenizer(500)
    foreign = models.transformers(build_llama(small, "tiny", seed=0, max_position_embeddings=512), small)
    with pytest.raises(ValueError, match="tokenizer"):
        gen("a", speculate=foreign)


@pytest.mark.slow
@pytest.mark.real
def test_extraction_on_a_trained_model_is_unchanged_and_takes_fewer_forwards():
    from support.real import smollm2

    from continuous import chat

    class Ticket(BaseModel):
        customer: str
        order_number: str
        city: str

    real = models.transformers(smollm2())
    message = ("Hello, my name is Maria Lopez and I live in Valencia. My order A-48213 arrived with a broken lid. "
               "Please send a new one to Maria Lopez, Valencia, order A-48213.")
    prompt = chat.prompt(real, [{"role": "user", "content": "Extract customer, order_number and city as JSON: "
                                 + message}])
    gen = continuous(generate.json(real, Ticket))
    base = gen(prompt, max_tokens=0)
    before = real.stats.forward_calls
    plain = gen(base, max_tokens=80)
    calls = real.stats.forward_calls - before
    before = real.stats.forward_calls
    state = gen(base, max_tokens=80, speculate=PromptLookup())
    same(plain, state)
    assert state.value.order_number == "A-48213"
    assert real.stats.forward_calls - before < calls
    text = continuous(generate.text(real))
    same(text(state + "\nThanks!", max_tokens=6), text(plain + "\nThanks!", max_tokens=6))


def test_concurrent_calls_with_and_without_drafts_each_equal_the_call_alone(model, other):
    """The engine merges forwards that keep logits for drafts with those that keep one."""
    from concurrent.futures import ThreadPoolExecutor

    prompt = "the cat sat the cat sat the cat"
    calls = [(KINDS[kind](model), spec) for kind in ("text", "json", "regex") for spec in (
        None, PromptLookup(k=4, ngram=2), DraftModel(other, k=2))]

    def run(call):
        made, spec = call
        return continuous(made)(prompt, max_tokens=20, speculate=spec)

    alone = [run(c) for c in calls]
    with ThreadPoolExecutor(len(calls)) as pool:
        together = list(pool.map(run, calls))
    for a, b in zip(alone, together):
        same(a, b)
