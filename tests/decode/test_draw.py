"""The calls that step together choose their tokens in one pass, and each row's tokens are
those it gets alone."""

import pytest
import torch

from continuous import continuous, generate, samplers
from continuous.decode.draw import Draw
from continuous.models.table import ALL


def _kinds(model):
    text = continuous(generate.text(model))
    return [
        (text, "User: tell me about Lima.\nAssistant:", dict(max_tokens=12)),
        (continuous(generate.json(model, {"type": "object", "properties": {"n": {"type": "integer"}},
                                          "required": ["n"]})), "JSON:", dict(max_tokens=16)),
        (continuous(generate.regex(model, r"[0-9]{3}-[a-z]{2,4}")), "Code:", {}),
        (text, ["Rome is", "Kyoto is a city"], dict(max_tokens=8, logprobs=2)),
        (text, "Once upon a time", dict(max_tokens=10, temperature=0.8, top_p=0.9, seed=3)),
        (text, "Oslo", dict(max_tokens=10, temperature=1.3, top_k=7, seed=4)),
        (continuous(generate.text(model, samplers.multinomial(2, min_p=0.1))), "Pick:", dict(max_tokens=6, seed=5)),
    ]


def test_every_call_of_a_step_draws_in_one_pass_per_sampler_kind_and_equals_the_call_alone(model, monkeypatch):
    kinds = _kinds(model)
    alone = [gen(prompt, **kw) for gen, prompt, kw in kinds]
    sizes = []
    run_all = Draw.run_all
    monkeypatch.setattr(Draw, "run_all", staticmethod(lambda draws: sizes.append(len(draws)) or run_all(draws)))
    engine = model.engine
    monkeypatch.setattr(engine, "_start_thread", lambda: None)  # stepped by hand, below
    streams = [gen.stream(prompt, **kw) for gen, prompt, kw in kinds]
    calls = [s._submitted() for s in streams]
    for call in calls:
        engine.ask(call, ALL)
    engine.step()  # every prefill, in one forward
    assert sizes == []
    engine.step()  # every call's first draw: the greedy ones together, the sampled ones together
    assert sorted(sizes) == [3, 4]
    while not all(c.done for c in calls):
        engine.step()
    for a, b in zip(alone, (s.run() for s in streams)):
        assert list(a) == list(b) and a.finish_reasons == b.finish_reasons
        assert a.token_ids.tolist() == b.token_ids.tolist()
        # A merged forward's matrix products round differently from one of a call's rows alone.
        assert torch.allclose(a.weights, b.weights, atol=1e-4)
        if a.logprobs is not None:
            assert [[t for t, _, _ in row] for row in a.logprobs] == [[t for t, _, _ in row] for row in b.logprobs]


def test_a_row_left_with_no_token_in_a_shared_draw_keeps_its_weight_and_fails_only_its_call(model, monkeypatch):
    """A processor that forbids every token: its call warns and ends; the call beside it is unchanged."""
    forbid = lambda ids, scores: torch.full_like(scores, -torch.inf)  # noqa: E731
    text = continuous(generate.text(model))
    plain = text("Hello", max_tokens=6)
    engine = model.engine
    monkeypatch.setattr(engine, "_start_thread", lambda: None)
    streams = [text.stream("Hello", max_tokens=6, logits_processors=[forbid]), text.stream("Hello", max_tokens=6)]
    calls = [s._submitted() for s in streams]
    for call in calls:
        engine.ask(call, ALL)
    with pytest.warns(UserWarning):
        while not all(c.done for c in calls):
            engine.step()
    blocked, other = (s.run() for s in streams)
    assert str(blocked) == "Hello" and float(blocked.weights[0]) == 0.0
    assert list(other) == list(plain) and torch.allclose(other.weights, plain.weights, atol=1e-4)
