"""Tokens a constraint forces: taken, not chosen, whether forwarded together or one per step."""

import pytest
import torch

from continuous import continuous, generate, samplers

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "city": {"enum": ["Paris", "Lima", "Oslo"]},
                                           "age": {"type": "integer"}},
          "required": ["name", "city", "age"], "additionalProperties": False}


def ids(state, row=0):
    return state.token_ids[row][state.attention_mask[row].bool()].tolist()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_seed_gives_the_same_samples_with_and_without_fast_forward(model, seed):
    sampler = samplers.multinomial(2, temperature=1.3)
    runs = {}
    for ff in (True, False):
        gen = continuous(generate.json(model, SCHEMA, sampler), fast_forward=ff)
        before = model.stats.snapshot()
        state = gen("Person: ", max_tokens=40, seed=seed)
        runs[ff] = state, model.stats.forward_calls - before["forward_calls"]
    (fast, fast_calls), (slow, slow_calls) = runs[True], runs[False]
    assert [ids(fast, r) for r in range(2)] == [ids(slow, r) for r in range(2)]
    assert list(fast) == list(slow)
    torch.testing.assert_close(fast.weights, slow.weights)
    assert fast_calls < slow_calls  # the forced keys went in one call each with fast-forward


def test_forced_tokens_carry_no_weight(model):
    gen = continuous(generate.choice(model, ["Zanzibar is far", "Paris"]), fast_forward=False)
    state = gen("City:")
    first = continuous(generate.choice(model, ["Zanzibar is far", "Paris"]))("City:")
    assert state.value == first.value
    torch.testing.assert_close(state.weights, first.weights)


@pytest.mark.parametrize("engine", ["llguidance", "outlines_core"])
def test_fast_forward_gives_the_same_tokens_in_fewer_forward_calls(model, engine):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5},
                                               "city": {"enum": ["Paris", "Lima"]}},
              "required": ["name", "city"], "additionalProperties": False}
    prompts = ["User: Tell me about Omar.\nAssistant:", "Hi"]
    runs = {}
    for ff in (True, False):
        gen = continuous(generate.json(model, schema, whitespace_pattern="", engine=engine), fast_forward=ff)
        before = model.stats.forward_calls
        state = gen(prompts, max_tokens=40)
        runs[ff] = (state, model.stats.forward_calls - before)
    (fast, fast_calls), (slow, slow_calls) = runs[True], runs[False]
    assert fast_calls < slow_calls
    assert list(fast) == list(slow) and fast.value == slow.value
    for r in range(2):
        assert ids(fast, r) == ids(slow, r)
    assert torch.allclose(fast.weights, slow.weights)
    # The forced tokens' cache is as good as one computed token by token.
    text = continuous(generate.text(model))
    assert list(text(fast + " and", max_tokens=4)) == list(text(fast.drop_cache() + " and", max_tokens=4))
