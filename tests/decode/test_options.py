"""A call's options: built once, checked once, with the call's signature visible."""

import inspect

import pytest

from continuous import continuous, generate, samplers
from continuous.decode import Options
from continuous.wrapper import ContinuousGenerator

UNIQUE = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}


def test_beam_search_refuses_every_rewinding_constraint_with_one_message(model):
    with pytest.raises(ValueError, match="beam search cannot serve ban="):
        generate.text(model, samplers.beam_search(2), ban=["x"])
    with pytest.raises(ValueError, match="beam search cannot serve a schema's uniqueItems"):
        generate.json(model, UNIQUE, samplers.beam_search(3))
    # A call's own sampler meets the same rule, before any step.
    for gen in (continuous(generate.text(model, ban=["x"])), continuous(generate.json(model, UNIQUE))):
        with pytest.raises(ValueError, match="beam search cannot serve"):
            gen("Numbers:", max_tokens=3, sampler=samplers.beam_search(2))
        with pytest.raises(ValueError, match="beam search cannot serve"):
            gen.stream("Numbers:", sampler=samplers.beam_search(2))
    # One beam ranks nothing against another: it rewinds as greedy does.
    generate.json(model, UNIQUE, samplers.beam_search(1))


def test_beam_search_serves_a_schema_whose_grammar_enforces_everything(model):
    gen = continuous(generate.json(model, {"type": "array", "items": {"type": "integer"}}, samplers.beam_search(2)))
    state = gen("Numbers:", max_tokens=4)
    assert state.num_samples == 2


def test_every_form_of_a_call_shows_the_call_s_arguments():
    call = inspect.signature(ContinuousGenerator.__call__)
    assert "max_tokens" in call.parameters and "logprobs" in call.parameters
    for name, extra in (("stream", ["partial"]), ("acall", []), ("astream", ["partial"])):
        method = getattr(ContinuousGenerator, name)
        assert list(inspect.signature(method).parameters) == list(call.parameters) + extra, name
        assert "logits_processors" in method.__doc__ and "Parameters" in method.__doc__
    assert inspect.iscoroutinefunction(ContinuousGenerator.acall)


def test_options_are_frozen_and_hold_the_call_s_sampler(model):
    options = Options.from_call(generate.text(model), 1, max_tokens=3, stop_at="x", temperature=0.5, seed=1)
    assert options.max_tokens == 3 and options.stop_at == ("x",)
    assert isinstance(options.sampler, samplers.Multinomial) and options.sampler.temperature == 0.5
    with pytest.raises(AttributeError):
        options.max_tokens = 4
    with pytest.raises(TypeError):
        Options.from_call(generate.text(model), 1, max_tokenz=3)


def test_speculate_is_an_option_checked_when_the_call_is_made(model):
    from continuous import PromptLookup
    from continuous.decode.speculate import DraftModel

    lookup = PromptLookup(k=2)
    assert Options.from_call(generate.text(model), 1, speculate=lookup).speculate is lookup
    drafter = Options.from_call(generate.text(model), 1, speculate=model).speculate  # a model drafts as DraftModel
    assert isinstance(drafter, DraftModel) and drafter.model is model
    assert Options.from_call(generate.text(model), 1).speculate is None
    gen = continuous(generate.text(model))
    for form in (gen, gen.stream):
        with pytest.raises(ValueError, match="beam search"):
            form("a", sampler=samplers.beam_search(2), speculate=lookup)
        with pytest.raises(ValueError, match="logits_processors"):
            form("a", logits_processors=[lambda ids, scores: scores], speculate=lookup)
        for penalty in ({"logit_bias": {3: 1.0}}, {"presence_penalty": 0.5}, {"frequency_penalty": -0.5}):
            with pytest.raises(ValueError, match="penalties"):
                form("a", speculate=lookup, **penalty)
        with pytest.raises(TypeError, match="speculate= takes"):
            form("a", speculate="ngram")
    assert "speculate" in inspect.signature(ContinuousGenerator.astream).parameters
