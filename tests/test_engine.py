"""The engine: threads sharing a cache's tip, holes squeezed out, masks per layer kind."""

import threading

import torch

from continuous import continuous, generate
from continuous.layout import interior_holes


def real_ids(state, row=0):
    return state.token_ids[row][state.attention_mask[row].bool()].tolist()


def test_threads_continuing_states_that_share_a_tip_write_their_own_slots(model):
    gen = continuous(generate.text(model))
    base = gen("User: Tell me about Omar.\nAssistant:", max_tokens=4)
    suffixes = [f" and then {w}" for w in ("Lima", "Oslo", "Kyoto", "Perth", "Cairo", "Quito")]
    start = model.stats.snapshot()
    alone = {s: gen(base + s, max_tokens=12) for s in suffixes}
    before = model.stats.snapshot()
    sequential = {k: before[k] - start[k] for k in before}
    results, errors = {}, []

    def run(s):
        try:
            results[s] = gen(base + s, max_tokens=12)
        except Exception as exc:  # surfaced below: a thread's exception would be lost
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(s,)) for s in suffixes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    after = model.stats.snapshot()
    # The counters lost no update: the same work as the sequential runs.
    assert {k: after[k] - before[k] for k in after} == sequential
    for s in suffixes:
        assert str(results[s]) == str(alone[s])
        assert real_ids(results[s]) == real_ids(alone[s])
        # Each result's cache holds its own tokens: continuing it equals recomputing it.
        assert real_ids(gen(results[s], max_tokens=3)) == real_ids(gen(results[s].drop_cache(), max_tokens=3))


def test_alternating_long_and_short_turns_keep_slots_near_tokens(model):
    gen = continuous(generate.text(model))
    state = gen(["User: Hi\nAssistant:", "User: Hello there\nAssistant:"], max_tokens=2)
    long_text = " ".join(["word"] * 12)
    new = len(model.tokenizer(long_text + "\nAssistant:", add_special_tokens=False).input_ids)
    for turn in range(8):
        texts = [long_text, " ok"] if turn % 2 == 0 else [" ok", long_text]
        before = state.attention_mask.sum(1).max().item()
        state = gen(state + [t + "\nAssistant:" for t in texts], max_tokens=3)
        # Holes of the cached part are squeezed out at each call: the grid is the longest
        # row's tokens plus this call's new ones, not the history of both rows.
        assert state.token_ids.shape[1] <= before + 1.125 * new + 3 + 2
    assert real_ids(gen(state, max_tokens=4), 1) == real_ids(gen(state.drop_cache(), max_tokens=4), 1)


def test_compaction_keeps_every_row_and_its_cache(model):
    gen = continuous(generate.text(model))
    state = gen(["a b c d e f g h i j k l m n o p", "x"], max_tokens=2)
    state = state + ["", " " + "y " * 40]
    state = gen(state, max_tokens=2)
    state = state + [" " + "z " * 40, ""]
    assert interior_holes(state.attention_mask)
    out = gen(state, max_tokens=5)
    ref = gen(state.drop_cache(), max_tokens=5)
    assert list(out) == list(ref)
    for r in range(2):
        assert real_ids(out, r) == real_ids(ref, r)


def test_interior_holes():
    assert not interior_holes(torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]]))
    assert interior_holes(torch.tensor([[0, 1, 0, 1], [1, 1, 1, 1]]))
    assert not interior_holes(torch.tensor([[1, 1, 0, 0]]))  # trailing holes: nothing after them


def test_fast_forward_gives_the_same_tokens_in_fewer_forward_calls(model):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5},
                                               "city": {"enum": ["Paris", "Lima"]}}, "required": ["name", "city"]}
    prompts = ["User: Tell me about Omar.\nAssistant:", "Hi"]
    runs = {}
    for ff in (True, False):
        gen = continuous(generate.json(model, schema), fast_forward=ff)
        before = model.stats.forward_calls
        state = gen(prompts, max_tokens=40)
        runs[ff] = (state, model.stats.forward_calls - before)
    (fast, fast_calls), (slow, slow_calls) = runs[True], runs[False]
    assert fast_calls < slow_calls
    assert list(fast) == list(slow) and fast.value == slow.value
    for r in range(2):
        assert real_ids(fast, r) == real_ids(slow, r)
    assert torch.allclose(fast.weights, slow.weights)
    # The forced tokens' cache is as good as one computed token by token.
    text = continuous(generate.text(model))
    assert list(text(fast + " and", max_tokens=4)) == list(text(fast.drop_cache() + " and", max_tokens=4))
