"""The automatic prefix cache: reuse equals recomputing, counts what it saves, stays within its bytes."""

import asyncio
import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from continuous import chat, continuous, generate, models, samplers
from continuous.prefix import PrefixCache, parse_bytes
from continuous.layout import encode

SYSTEM = "System: you are a helpful assistant who answers briefly and well.\n"


@pytest.fixture
def cached(hf_model, tokenizer):
    model = models.transformers(hf_model, tokenizer, prefix_cache="64MB")
    model.prefix_cache.clear()  # the wrapper is shared by the tests: each starts with nothing kept
    return model


def test_it_is_off_by_default(model):
    assert model.prefix_cache is None
    state = continuous(generate.text(model))(SYSTEM, max_tokens=2)
    assert state.tokens_cached == 0


def test_a_prompt_starting_like_a_kept_state_forwards_only_the_rest(cached, model):
    gen, plain = continuous(generate.text(cached)), continuous(generate.text(model))
    first = gen(SYSTEM + "User: tell me about Lima.\nAssistant:", max_tokens=8)
    prompt = SYSTEM + "User: tell me about Oslo.\nAssistant:"
    cached.stats.reset()
    model.stats.reset()
    again = gen(prompt, max_tokens=8)
    alone = plain(prompt, max_tokens=8)
    assert list(again) == list(alone) and again.token_ids.tolist()[0][-8:] == alone.token_ids.tolist()[0][-8:]
    assert again.finish_reasons == alone.finish_reasons
    ids = cached.tokenizer(prompt)["input_ids"]
    kept = first._rows.real_ids(0)
    common = next(i for i, (a, b) in enumerate(zip(ids, kept + [None] * len(ids))) if a != b)
    assert again.tokens_cached == common == cached.stats.tokens_cached
    assert cached.stats.tokens_forwarded == model.stats.tokens_forwarded - common
    # The state continues as one made without the cache.
    assert list(gen(again + " More", max_tokens=5)) == list(plain(alone + " More", max_tokens=5))


def test_a_stream_closed_while_sharing_its_steps_keeps_what_the_cache_supplied_and_only_its_own_memory(cached):
    gen = continuous(generate.text(cached))
    gen(SYSTEM + "User: tell me about Lima.\nAssistant:", max_tokens=4)  # kept: the stream's prompt starts alike

    async def main():
        stream = gen.astream(SYSTEM + "User: tell me about Oslo.\nAssistant:", max_tokens=20)
        other = asyncio.ensure_future(gen.acall("Once upon a time", max_tokens=20))  # shares the stream's steps
        async for _ in stream:
            break
        await stream.aclose()
        await other
        return stream.state

    state = asyncio.run(main())
    assert state.tokens_cached > 0
    logits = state._rows.logits
    assert logits.untyped_storage().nbytes() == logits.nelement() * logits.element_size()


def test_with_healing_only_tokens_not_forwarded_again_count_as_cached(cached, model):
    from continuous.heal import heal_length, token_strings

    gen, plain = continuous(generate.text(cached)), continuous(generate.text(model))
    strings, healed = token_strings(cached.tokenizer), 0
    for prompt in [SYSTEM + "User: visit www.exa", SYSTEM + "User: the quick bro", SYSTEM + "User: hello"]:
        gen(prompt, max_tokens=2)  # kept whole: the next call could take all but its last token
        ends = list(gen(prompt, max_tokens=0)._rows.ends[0])
        k = heal_length(strings, prompt, ends, first=sum(e == 0 for e in ends))
        healed += k > 0
        cached.stats.reset()
        model.stats.reset()
        state = gen(prompt, max_tokens=4, heal=True)
        assert list(state) == list(plain(prompt, max_tokens=4, heal=True))
        # Healing crops the last k tokens and the last kept one is forwarded for its logits.
        assert state.tokens_cached == cached.stats.tokens_cached == len(ends) - k - 1
        assert cached.stats.tokens_forwarded == model.stats.tokens_forwarded - state.tokens_cached
    assert healed >= 1


CHATML = ("{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + '\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")


def _common(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_a_chat_resent_whole_each_turn_forwards_only_each_turns_new_tokens(hf_model, tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = CHATML
    cached, plain = (models.transformers(hf_model, tok, prefix_cache=p) for p in ("64MB", None))
    gen, ref = continuous(generate.text(cached)), continuous(generate.text(plain))
    messages, kept = [], []
    for turn in range(5):
        messages.append({"role": "user", "content": f"Question number {turn}?"})
        prompt = chat.prompt(cached, messages)
        ids = encode(tok, prompt, special=True)[0]  # as the call encodes it: a reply's "<s>" is text
        cached.stats.reset()
        state = gen(prompt, max_tokens=6)
        assert list(state) == list(ref(prompt, max_tokens=6))
        # Only what no earlier turn's state holds is forwarded (and the last token, for its logits).
        expected = min(max((_common(ids, k) for k in kept), default=0), len(ids) - 1)
        assert state.tokens_cached == expected > (0 if kept else -1)
        forwarded = cached.stats.tokens_forwarded - (len(state.token_ids[0]) - len(ids))  # less decode steps
        assert forwarded <= len(ids) - expected + 1
        kept.append(state._rows.real_ids(0)[: int(state._rows.cached_lengths()[0])])
        messages.append({"role": "assistant", "content": state.value})


def test_rows_of_a_batch_each_take_their_own_prefix(cached, model):
    gen, plain = continuous(generate.text(cached)), continuous(generate.text(model))
    gen([SYSTEM + "User: hi", "A wholly different text about cats"], max_tokens=4)
    prompts = [SYSTEM + "User: hello", "Nothing alike", "A wholly different text about dogs"]
    state = gen(prompts, max_tokens=5)
    assert list(state) == list(plain(prompts, max_tokens=5))
    assert state.tokens_cached > 0


def test_samples_share_one_buffer_counted_once(cached):
    gen = continuous(generate.text(cached, samplers.multinomial(3)))
    gen(SYSTEM, max_tokens=4, seed=1)
    kept = cached.prefix_cache
    assert len(kept) == 3
    assert kept.bytes == next(iter(kept.entries.values()))[0].cache.storage()[1]


def test_the_least_recently_used_rows_go_first_within_the_budget(hf_model, tokenizer):
    probe = models.transformers(hf_model, tokenizer, prefix_cache="1GB")
    continuous(generate.text(probe))("x", max_tokens=1)
    one = probe.prefix_cache.bytes  # one short state's buffer
    model = models.transformers(hf_model, tokenizer, prefix_cache=2 * one)
    gen = continuous(generate.text(model))
    gen("Alpha text here", max_tokens=2)
    gen("Beta text here", max_tokens=2)
    touched = gen("Alpha text here and more", max_tokens=2)  # reuses Alpha: now the most recent
    assert touched.tokens_cached > 0
    gen("Gamma text here", max_tokens=2)
    assert model.prefix_cache.bytes <= 2 * one
    assert gen("Alpha text here again", max_tokens=1).tokens_cached > 0
    assert gen("Beta text here again", max_tokens=1).tokens_cached == 0


@pytest.mark.parametrize("size, expected", [(1024, 1024), ("2GB", 2 * 10**9), ("512MiB", 512 * 2**20),
                                            (" 1.5 kb ", 1500), ("0", 0), ("3e3", 3000)])
def test_sizes_read_as_bytes(size, expected):
    assert parse_bytes(size) == expected


@pytest.mark.parametrize("size", ["2 parsecs", "", "-1GB", -5, 1.5, True, None, "GB"])
def test_a_size_that_is_not_one_is_refused(size):
    with pytest.raises(ValueError, match="cache size"):
        parse_bytes(size)


def test_a_bad_prefix_cache_is_refused_when_the_model_is_wrapped(hf_model, tokenizer):
    with pytest.raises(ValueError, match="cache size"):
        models.transformers(hf_model, tokenizer, prefix_cache="lots")


class _Rows:
    """Just what the trie reads of a state's rows: one row of ids, on a buffer of its own of ``size`` bytes."""

    class _Cache:
        def __init__(self, size):
            self.buffer, self.size = object(), size

        def storage(self):
            return self.buffer, self.size

    def __init__(self, ids, size=10):
        self.ids, self.n_rows, self.cache = list(ids), 1, self._Cache(size)

    def cached_lengths(self):
        return torch.tensor([len(self.ids)])

    def real_ids(self, r):
        return self.ids


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=8), min_size=1, max_size=12),
       st.lists(st.integers(0, 3), max_size=8), st.integers(10, 60))
def test_the_trie_finds_the_longest_prefix_among_the_rows_it_still_keeps(inserted, query, budget):
    kept = PrefixCache(budget)
    for ids in inserted:
        kept.insert(_Rows(ids))
    assert kept.bytes <= budget and kept.bytes == 10 * len(kept.entries)
    live = [e[2] for e in kept.entries.values()]
    best = max((next((i for i, (a, b) in enumerate(zip(q, query)) if a != b), min(len(q), len(query)))
                for q in live), default=0)
    key, depth = kept._longest(query)
    assert depth == best
    if depth:
        assert tuple(query[:depth]) == kept.entries[key][2][:depth]


def test_a_state_larger_than_the_budget_is_not_kept_and_evicts_nothing():
    kept = PrefixCache(30)
    for ids in ([1, 2, 3], [4, 5, 6]):
        kept.insert(_Rows(ids))
    kept.insert(_Rows([7, 8, 9], size=31))
    assert [e[2] for e in kept.entries.values()] == [(1, 2, 3), (4, 5, 6)] and kept.bytes == 20
    assert kept._longest([7, 8, 9]) == (None, 0) and kept._longest([1, 2, 3])[1] == 3


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 3), min_size=1, max_size=6), st.integers(1, 50)),
                min_size=1, max_size=15), st.integers(0, 60))
def test_inserts_of_any_sizes_stay_within_the_budget_and_an_oversized_one_evicts_nothing(inserts, budget):
    kept = PrefixCache(budget)
    for ids, size in inserts:
        before = list(kept.entries.values())
        kept.insert(_Rows(ids, size))
        assert kept.bytes <= budget
        assert kept.bytes == sum(e[0].cache.size for e in kept.entries.values())
        if size > budget:
            assert list(kept.entries.values()) == before  # nothing evicted, nothing added
        else:
            assert kept._depth(tuple(ids)) == len(ids)  # what fits is found (the oldest went for it)
