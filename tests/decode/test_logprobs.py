"""Log-probabilities: they sum to what the call added to each row's weight, an end id included."""

import math

from continuous import continuous, generate, samplers


def test_a_sampled_end_id_has_its_entry_and_the_sum_rule_holds(model):
    gen = continuous(generate.choice(model, ["a", "ab", "abc", "b"], samplers.multinomial()))
    eos = model.tokenizer.decode([model.tokenizer.eos_token_id])
    ended = 0
    for seed in range(6):
        state = gen("Letter:", seed=seed, logprobs=2)
        (row,) = state.logprobs
        assert math.isclose(sum(lp for _, lp, _ in row), float(state.weights[0, 0]), abs_tol=1e-5)
        if row[-1][0] == eos:  # the row chose to end where it could go on
            ended += 1
            assert state.finish_reasons == ["eos"] and row[-1][1] < 0
    assert ended


def test_logprobs_zero_lists_no_alternatives_for_any_token(model):
    gen = continuous(generate.choice(model, ["a long answer here"]))
    (row,) = gen("Q:", logprobs=0).logprobs
    assert len(row) > 1 and row[-1][1] == 0.0  # the last tokens were forced
    assert all(alts == [] for _, _, alts in row)
