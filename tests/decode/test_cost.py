"""The constraint's cost: the nats its mask removed at each step, against the HF model's own logits."""

import math

import pytest
import torch

from continuous import continuous, generate
from continuous.decode.constraints import RowConstraints


def _direct_cost(hf_model, model, constraint, ids: list[int], n_prompt: int) -> float:
    """Sum over generated tokens of -log(mass the constraint allowed), from one full forward."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0].float()
    tokenizer = model.tokenizer
    rows = RowConstraints(constraint, 1, logits.shape[-1], len(tokenizer), tokenizer.eos_token_id,
                          torch.device("cpu"), also_eos=model.eos_token_ids)
    total = 0.0
    for p in range(n_prompt, len(ids)):
        scores = logits[p - 1]
        allowed = rows.allowed()[0]
        total += float(torch.logsumexp(scores, -1) - torch.logsumexp(scores[allowed], -1))
        rows.advance(0, ids[p])
    return total


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.7, "seed": 3}])
def test_the_cost_is_the_mass_the_constraint_removed_at_each_step(hf_model, model, sampling):
    gen = generate.regex(model, r"[0-9]{3}-[a-z]{2}")
    prompt = "Code:"
    state = continuous(gen, fast_forward=False)(prompt, **sampling)
    n_prompt = len(model.tokenizer(prompt).input_ids)
    ids = state.token_ids[0].tolist()
    assert state.finish_reasons == ["eos"] and len(ids) > n_prompt
    expected = _direct_cost(hf_model, model, gen.constraint, ids, n_prompt)
    assert expected > 0.1  # the random model wants letters where digits must come
    assert math.isclose(state.constraint_cost[0], expected, rel_tol=1e-3, abs_tol=1e-3)


def test_free_text_costs_nothing_and_rows_select_theirs(model):
    free = continuous(generate.text(model))(["a", "b c"], max_tokens=3)
    assert free.constraint_cost == [0.0, 0.0]
    choice = continuous(generate.choice(model, ["yes", "no"]))(["Q1:", "Question two:"])
    assert all(c > 0 for c in choice.constraint_cost)
    assert choice[1, :].constraint_cost == [choice.constraint_cost[1]]
