"""SequenceState: indexing, adding, values, and the invariants of continuing a state."""

import warnings

import pytest
import torch
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from support.models import build_llama
from support.states import all_real_ids, assert_equivalent

from continuous import (
    BatchMismatch,
    CacheResetWarning,
    SampleMismatch,
    continuous,
    generate,
    models,
    samplers,
)

PROMPTS = ["Alice is 30 years old", "Bob", "Order #1042: 3 x lamp shipped to Oslo"]


def top1(samples):
    """A deterministic sampler of `samples` rows (top_k=1 is argmax)."""
    return samplers.multinomial(samples, top_k=1)


@pytest.fixture(scope="module")
def greedy(model):
    return continuous(generate.text(model))


@pytest.fixture(scope="module", params=[(1, 1), (1, 3), (3, 1), (3, 3)], ids=lambda p: f"b{p[0]}s{p[1]}")
def shaped(request, model):
    batch, samples = request.param
    gen = continuous(generate.text(model, top1(samples)))
    prompts = PROMPTS[:batch] if batch > 1 else PROMPTS[0]
    return gen(prompts, max_tokens=4), batch, samples


def texts_2d(state):
    rows = list(state)
    return [rows[b * state.num_samples:(b + 1) * state.num_samples] for b in range(state.batch_size)]


def test_every_index_form_gives_the_right_text(shaped):
    state, batch, samples = shaped
    grid = texts_2d(state)
    assert state.batch_size == batch and state.num_samples == samples
    for b in range(batch):
        for s in range(samples):
            for chars in (slice(None, 7), slice(0, 12), slice(None), slice(2, 9), slice(-5, None)):
                sub = _quiet(lambda: state[b, s, chars])
                assert list(sub) == [grid[b][s][chars]]
                assert (sub.batch_size, sub.num_samples) == (1, 1)
                if samples == 1:
                    assert list(_quiet(lambda: state[b, chars])) == [grid[b][0][chars]]
                if batch == 1:
                    assert list(_quiet(lambda: state[s, chars])) == [grid[0][s][chars]]
                if batch == 1 and samples == 1:
                    assert list(_quiet(lambda: state[chars])) == [grid[0][0][chars]]
            assert state[b, s, 3] == grid[b][s][3]
    # slices of rows keep the shape of what they select
    sub = state[0:batch, 0:samples, :5]
    assert texts_2d(sub) == [[t[:5] for t in row] for row in grid]
    if batch > 1 and samples > 1:
        assert state[:, :, 0] == [[t[0] for t in row] for row in grid]
        with pytest.raises(IndexError):
            state[0, :4]


def test_prefix_slices_keep_cache_of_every_selected_row(shaped, greedy):
    state, batch, samples = shaped
    sub = state[0:batch, 0:samples, :9]
    assert sub.kv_cache is not None
    assert all(c > 0 for c in sub.cached_lengths.tolist())
    assert torch.equal(sub.weights, state.weights)


def test_slices_after_zero_reset_the_cache_with_a_warning(shaped):
    state, _, _ = shaped
    with pytest.warns(CacheResetWarning):
        sub = state[0, 0, 2:9]
    assert sub.kv_cache is None and sub.cached_lengths.tolist() == [0]
    assert str(sub) == list(state)[0][2:9]


def test_row_selection_keeps_cache_and_weights(model):
    gen = continuous(generate.text(model, top1(3)))
    state = gen(PROMPTS, max_tokens=3)
    sub = state[1:3, 1, :]
    assert (sub.batch_size, sub.num_samples) == (2, 1)
    assert sub.kv_cache is not None
    assert sub.cached_lengths.tolist() == [state.cached_lengths[4].item(), state.cached_lengths[7].item()]
    assert torch.equal(sub.weights.flatten(), state.weights[1:3, 1])


def test_bad_keys(shaped):
    state, batch, samples = shaped
    with pytest.raises(ValueError):
        state[0, 0, ::2]
    with pytest.raises(IndexError):
        state[batch, 0, :3]
    with pytest.raises(IndexError):
        state[0, samples, :3]
    with pytest.raises(IndexError):
        state[0, 0, 10_000]
    with pytest.raises(TypeError):
        state[0, 0, "a"]
    with pytest.raises(IndexError):
        state[0, 0, 0, 0]


def test_adding_text(model, greedy, tokenizer):
    state = greedy(PROMPTS[0], max_tokens=3)
    more = state + " and Bob"
    assert str(more) == str(state) + " and Bob"
    assert str(state) == list(state)[0]  # the operand did not change
    assert torch.equal(more.weights, state.weights)
    assert more.kv_cache is not None
    prompt_only = greedy(PROMPTS[0], max_tokens=0)
    # A prompt-only state plus text has the tokens of the whole text, around the boundary too.
    for suffix in [" and Bob", "s", "0 years", ""]:
        joined = prompt_only + suffix
        assert joined._rows.real_ids(0) == tokenizer(PROMPTS[0] + suffix).input_ids


def test_adding_lists_and_states(model):
    gen = continuous(generate.text(model, top1(2)))
    state = gen(PROMPTS[:2], max_tokens=2)
    per_row = state + ["a", "b", "c", "d"]
    assert list(per_row) == [t + x for t, x in zip(state, "abcd")]
    per_prompt = state + ["x", "y"]
    assert list(per_prompt) == [t + x for t, x in zip(state, "xxyy")]
    with pytest.raises(BatchMismatch):
        state + ["a", "b", "c"]
    summed = state + state
    assert list(summed) == [t + t for t in state]
    assert torch.allclose(summed.weights, 2 * state.weights)
    assert summed.kv_cache is not None
    with pytest.raises(BatchMismatch):
        state + gen(PROMPTS, max_tokens=1)
    with pytest.raises(SampleMismatch):
        state + continuous(generate.text(model, top1(3)))(PROMPTS[:2], max_tokens=1)
    with pytest.raises(TypeError):
        state + 3
    with pytest.raises(TypeError):
        state + ["a", 1, "b", "c"]


def test_adding_states_of_different_models(model, tokenizer):
    other = models.transformers(build_llama(tokenizer, "tiny", seed=1), tokenizer)
    a = continuous(generate.text(model))("x", max_tokens=1)
    b = continuous(generate.text(other))("x", max_tokens=1)
    with pytest.raises(ValueError):
        a + b


def test_text_before_a_state_resets_the_cache(greedy):
    state = greedy(PROMPTS[0], max_tokens=2)
    with pytest.warns(CacheResetWarning):
        new = "Hello " + state
    assert str(new) == "Hello " + str(state)
    assert new.kv_cache is None
    assert torch.equal(new.weights, state.weights)


def test_adding_empty_text_gives_the_state_as_it_is(model, greedy):
    state = greedy(PROMPTS[:2], max_tokens=4)  # generated tokens: not all as the tokenizer splits the text
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no CacheResetWarning
        same = ["" + state, state + "", state + ["", ""]]
    for new in same:
        assert torch.equal(new.token_ids, state.token_ids)
        assert torch.equal(new.cached_lengths, state.cached_lengths)
        assert new.value == state.value and torch.equal(new.weights, state.weights)

    def continued(s):  # the texts, and the tokens forwarded for them
        before = model.stats.snapshot()["tokens_forwarded"]
        return list(greedy(s, max_tokens=2)), model.stats.snapshot()["tokens_forwarded"] - before

    assert continued("" + state) == continued(state)


def test_value_iter_str_repr_drop_cache(model):
    gen = continuous(generate.choice(model, ["yes", "no"], top1(2)))
    state = gen(PROMPTS[:2])
    assert len(state.value) == 2 and all(len(v) == 2 for v in state.value)
    assert all(v in ("yes", "no") for row in state.value for v in row)
    assert len(list(state)) == 4
    assert "batch_size=2" in repr(state) and "num_samples=2" in repr(state)
    dropped = state.drop_cache()
    assert dropped.kv_cache is None and dropped.cached_lengths.tolist() == [0] * 4
    assert state.kv_cache is not None
    one = state[0, 0, :]
    assert one.value in ("yes", "no") and str(one) == list(state)[0]


# ---------------------------------------------------------------- invariants

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("gen"), st.integers(1, 4)),
        st.tuples(st.just("slice"), st.integers(0, 60)),
        st.tuples(st.just("slice_from"), st.integers(1, 10)),
        st.tuples(st.just("text"), st.sampled_from([" and", "s", " Paris.", "\n{", "0", " é"])),
        st.tuples(st.just("texts"), st.sampled_from([["a", " b"], [" lives", "é"]])),
        st.tuples(st.just("state"), st.just(None)),
        st.tuples(st.just("rows"), st.integers(0, 1)),
    ),
    min_size=1, max_size=5,
)


def apply(op, arg, state, gen):
    if op == "gen":
        return gen(state, max_tokens=arg)
    if op == "slice":
        return state[0:state.batch_size, :arg]
    if op == "slice_from":
        return _quiet(lambda: state[0:state.batch_size, arg:])
    if op == "text":
        return state + arg
    if op == "texts":
        return state + arg[:state.batch_size] if state.batch_size == 2 else state + arg[0]
    if op == "state":
        return state + state
    if op == "rows":
        return state[arg % state.batch_size:arg % state.batch_size + 1, :] if state.batch_size > 1 else state


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS, batch=st.sampled_from([1, 2]))
def test_any_sequence_of_operations_matches_recomputing(model, ops, batch):
    gen = continuous(generate.text(model))
    state = gen(PROMPTS[:2] if batch == 2 else PROMPTS[0], max_tokens=3)
    for op, arg in ops:
        before = list(state)
        state2 = apply(op, arg, state, gen)
        assert list(state) == before  # values: the operand never changes
        state = state2
    assert_equivalent(gen, state, n=4)


def _common(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _held_after(op, arg, before, out, held):
    """The ids whose K/V each row of ``out`` holds, derived from the operation alone.

    A call holds everything but each row's last (sampled, never forwarded) token; a
    slice or an addition keeps what its operand held (the ids that still agree are
    found by comparing ids); a slice that starts after 0 in some row holds nothing; a row
    selection keeps the selected rows.
    """
    if op == "gen":
        return [ids[:-1] for ids in all_real_ids(out)]
    if op == "slice_from":  # from character 0 of every row (all empty), the state is kept as it is
        return [[] for _ in held] if any(list(before)) else held
    if op == "rows" and before.batch_size > 1:
        return [held[arg % before.batch_size]]
    return held


def _generated(state, out):
    counts = [len(b) - len(a) for a, b in zip(all_real_ids(state), all_real_ids(out))]
    # A row that stopped (EOS) before the others may have its last token forwarded in
    # the batch's next step: the operations alone cannot say, so such runs are skipped.
    assume(len(set(counts)) == 1)
    return counts


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS)
@example(ops=[("slice", 0), ("slice_from", 1), ("text", " and")])  # an empty text sliced from 1 keeps its cache
def test_no_waste(model, ops):
    """tokens_forwarded grows by exactly the tokens the state's cache lacks, plus generated ones.

    What the cache lacks is derived from the operations and the token ids ,
    never from the library's own accounting.
    """
    gen = continuous(generate.text(model))
    state = gen(PROMPTS[:2], max_tokens=3)
    _generated(gen(PROMPTS[:2], max_tokens=0), state)
    held = [ids[:-1] for ids in all_real_ids(state)]
    for op, arg in ops:
        new = apply(op, arg, state, gen)
        if op == "gen":
            _generated(state, new)
        held = _held_after(op, arg, state, new, held)
        state = new
    # A row whose ids are all held still forwards its last token: its logits are gone.
    lacking = [len(ids) - min(_common(ids, h), len(ids) - 1) for ids, h in zip(all_real_ids(state), held)]
    assert all(n <= len(ids) for n, ids in zip(lacking, all_real_ids(state)))
    before = model.stats.tokens_forwarded
    out = gen(state, max_tokens=4)
    generated = _generated(state, out)
    assert model.stats.tokens_forwarded - before == sum(lacking) + sum(g - 1 for g in generated if g)


def test_branches_from_one_prefix_continue_in_any_order(model):
    gen = continuous(generate.text(model))
    base = gen(PROMPTS[0], max_tokens=3)
    a, b = base + " and Bob", base + " in Lima"
    alone_a = list(gen(a.drop_cache(), max_tokens=5))
    alone_b = list(gen(b.drop_cache(), max_tokens=5))
    assert list(gen(b, max_tokens=5)) == alone_b
    assert list(gen(a, max_tokens=5)) == alone_a
    assert list(gen(base[:10], max_tokens=5)) == list(gen(base[:10].drop_cache(), max_tokens=5))
    assert list(gen(a, max_tokens=5)) == alone_a


def _quiet(fn):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CacheResetWarning)
        return fn()


# ---------------------------------------------------------------- a state as a string
def test_a_state_is_a_string_for_in_bool_and_len(greedy):
    state = greedy("My name is Omar", max_tokens=3)
    text = str(state)
    for part in ("Omar", "name is", text, text[-3:], "", "not in it at all"):
        assert (part in state) == (part in text)
    assert bool(state) and len(state) == len(list(state)) == 1
    with pytest.raises(TypeError, match="requires a str"):
        3 in state


def test_in_bool_and_len_over_rows(model):
    state = continuous(generate.text(model, top1(2)))(["Omar", "Lina"], max_tokens=2)
    assert len(state) == len(list(state)) == 4
    assert "Omar" in state and "Lina" in state and "Zed" not in state
    empty = state[:, :, :0]
    assert not empty and len(empty) == 4 and list(empty) == [""] * 4


def test_exposed_tensors_cannot_change_a_state(greedy):
    s = greedy("Alice", max_tokens=2)
    t = s + "x"
    before = [x.clone() for x in (s.weights, s.token_ids, s.attention_mask, t.weights)]
    with pytest.raises(AttributeError, match="value"):
        t.weights += 100  # the in-place add hits a copy; assigning it back is refused
    for tensor in (t.weights, t.token_ids, t.attention_mask, s.weights, s.token_ids):
        tensor += 7
    after = (s.weights, s.token_ids, s.attention_mask, t.weights)
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert_equivalent(greedy, t)


@pytest.mark.parametrize("name", ["weights", "model", "batch_size", "num_samples", "_rows", "new"])
def test_attributes_are_read_only(greedy, name):
    s = greedy("Alice", max_tokens=1)
    with pytest.raises(AttributeError, match="value"):
        setattr(s, name, None)
    with pytest.raises(AttributeError):
        delattr(s, name)
    assert s.batch_size == 1 and s.model is not None


def test_copies_continue_on_the_same_model_and_pickle_is_refused(greedy):
    import copy
    import pickle

    s = greedy("Alice", max_tokens=2)
    for c in (copy.copy(s), copy.deepcopy(s), copy.deepcopy([s])[0]):
        assert c.model is s.model and str(c) == str(s)
        assert str(greedy(c, max_tokens=3)) == str(greedy(s, max_tokens=3))
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(s)
    assert str(greedy(s, max_tokens=1)).startswith(str(s))  # still usable


def test_cache_bytes_say_what_a_state_holds_alone_and_shares(model):
    import gc

    gen = continuous(generate.text(model))
    first = gen("Once upon a time", max_tokens=4)
    alone, shared = first.cache_bytes
    assert shared == 0 and alone > 0
    layers, heads = model.model.config.num_hidden_layers, model.model.config.num_key_value_heads
    head_dim = model.model.config.hidden_size // model.model.config.num_attention_heads
    capacity = first.kv_cache.capacity
    assert alone == 2 * layers * heads * head_dim * capacity * 4  # keys and values, float32
    second = gen(first, max_tokens=3)  # grows in the same buffer
    assert first.cache_bytes == (0, alone) and second.cache_bytes.shared == alone
    del first
    gc.collect()
    assert second.cache_bytes == (alone, 0)
    other = gen("Another story", max_tokens=2)  # a buffer of its own
    assert other.cache_bytes.shared == 0 and second.cache_bytes == (alone, 0)
    assert second.drop_cache().cache_bytes == (0, 0)
