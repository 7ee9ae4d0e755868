"""ban=: detection against brute force, rewinds, and the loop's guarantees (SPEC section 6)."""

import warnings

import pytest
import regex
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from continuous import BanExhausted, continuous, generate, samplers
from continuous.ban import BanList

ALPHABET = "abcAB "
phrases_st = st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=4), min_size=1, max_size=6)


def pieces(text, cuts):
    cuts = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in zip(cuts, cuts[1:])]


def first_match(phrases, text):
    """Brute force: the match that ends first (the longest of those ending there), as (start, phrase)."""
    low = text.lower()
    for end in range(1, len(text) + 1):
        hits = [p for p in phrases if low[:end].endswith(p.lower())]
        if hits:
            p = max(hits, key=len)
            return end - len(p), p
    return None


@settings(max_examples=200, deadline=None)
@given(phrases=phrases_st, text=st.text(alphabet=ALPHABET, max_size=20), cuts=st.lists(st.integers(0, 20)))
def test_the_first_match_is_found_whatever_the_pieces(phrases, text, cuts):
    matcher = BanList(phrases).matcher()
    found = None
    for piece in pieces(text, cuts):
        found = matcher.feed(piece)
        if found is not None:
            break
    expected = first_match(phrases, text)
    assert (found[0] if found else None) == (expected[0] if expected else None)


@settings(max_examples=200, deadline=None)
@given(phrases=phrases_st, text=st.text(alphabet=ALPHABET, max_size=20))
def test_held_back_text_is_exactly_what_could_still_become_a_match(phrases, text):
    matcher = BanList(phrases).matcher()
    if any(matcher.feed(c) for c in text):
        return
    low = text.lower()
    expected = max((k for k in range(1, len(text) + 1) for p in phrases if p.lower().startswith(low[-k:])),
                   default=0)
    assert matcher.held() == expected


@settings(max_examples=100, deadline=None)
@given(phrases=phrases_st, text=st.text(alphabet=ALPHABET, max_size=20), keep=st.integers(0, 20),
       more=st.text(alphabet=ALPHABET, max_size=8))
def test_a_rewind_equals_a_fresh_matcher_fed_the_shorter_text(phrases, text, keep, more):
    ban = BanList(phrases)
    keep = min(keep, len(text))
    rewound, fresh = ban.matcher(), ban.matcher()
    for c in text:
        rewound.feed(c)
    rewound.rewind(keep)
    for c in text[:keep]:
        fresh.feed(c)
    assert rewound.held() == fresh.held()
    assert [rewound.feed(c) for c in more] == [fresh.feed(c) for c in more]


def test_patterns_are_found_and_held_while_partial():
    matcher = BanList([regex.compile(r"not \w+ but")]).matcher()
    assert matcher.feed("it is not") is None and matcher.held() == 3
    assert matcher.feed(" this") is None and matcher.held() == len("not this")
    assert matcher.feed(" but that") == (6, 0.0)


def test_case_and_soft_factors():
    assert BanList(["Tapestry"]).matcher().feed("a TAPESTRY") == (2, 0.0)
    assert BanList(["Tapestry"], case_sensitive=True).matcher().feed("a TAPESTRY") is None
    assert BanList({"tapestry": 0.5}).matcher().feed("tapestry") == (0, 0.5)


@pytest.mark.parametrize("bad, error", [([""], ValueError), ("tapestry", TypeError), ([3], TypeError),
                                        ({"x": 1.5}, ValueError), ({"x": -1}, ValueError)])
def test_bad_ban_lists_are_refused(bad, error):
    with pytest.raises(error):
        BanList(bad)


# ------------------------------------------------------------------ in the decoding loop
def real_ids(state, row=0):
    return state.token_ids[row][state.attention_mask[row].bool()].tolist()


def banned_from_a_free_run(model, prompt, n=3):
    free = continuous(generate.text(model))(prompt, max_tokens=24).value
    words = [w for w in free.split() if len(w) >= 3]
    return words[:n], free


@pytest.mark.parametrize("sampler", [samplers.greedy(), samplers.multinomial(2)], ids=["greedy", "multinomial"])
def test_no_output_or_streamed_piece_contains_banned_text(model, sampler):
    prompt = "User: Tell me about Omar.\nAssistant:"
    banned, free = banned_from_a_free_run(model, prompt)
    assert banned and any(b in free for b in banned)
    gen = continuous(generate.text(model, sampler, ban=banned))
    before = model.stats.snapshot()
    state = gen(prompt, max_tokens=24, seed=3)
    values = state.value if isinstance(state.value, list) else [state.value]
    for v in values:
        assert not any(b.lower() in v.lower() for b in banned)
    if sampler.samples == 1 and not hasattr(sampler, "temperature"):  # greedy redoes the free run: it rewound
        assert model.stats.tokens_rewound > before["tokens_rewound"]
    streamed = []
    stream = gen.stream(prompt, max_tokens=24, seed=3)
    for piece in stream:
        streamed.append(piece)
    rows = list(zip(*streamed)) if isinstance(streamed[0], list) else [streamed]
    for r, row in enumerate(rows):
        assert "".join(row) == values[r]  # nothing streamed was taken back
        assert not any(b.lower() in "".join(row).lower() for b in banned)


def test_a_rewound_state_equals_its_recomputation_and_weights_are_masked_logprobs(model, hf_model):
    prompt = "User: Tell me about Omar.\nAssistant:"
    banned, _ = banned_from_a_free_run(model, prompt)
    state = continuous(generate.text(model, ban=banned))(prompt, max_tokens=20)
    text = continuous(generate.text(model))
    assert real_ids(text(state, max_tokens=5)) == real_ids(text(state.drop_cache(), max_tokens=5))
    # Weight: each kept token's log-probability under the distribution sampled from, the
    # bans at its position applied. Greedy keeps the best token not banned there, so the
    # banned ones are exactly those above it (recomputed from scratch).
    ids = real_ids(state)
    start = len(model.tokenizer(prompt).input_ids)
    total = 0.0
    for i in range(start, len(ids)):
        with torch.no_grad():
            logits = hf_model(torch.tensor([ids[:i]])).logits[0, -1].float()
        sampled = logits.masked_fill(logits > logits[ids[i]], -torch.inf)
        total += torch.log_softmax(sampled, -1)[ids[i]].item()
    assert state.weights.item() == pytest.approx(total, abs=1e-3)


def test_a_position_with_every_token_banned_ends_cleanly(model):
    gen = continuous(generate.choice(model, ["alpha", "alps"], ban=["al"]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = gen("Answer:")
    assert any(issubclass(w.category, BanExhausted) for w in caught)
    assert str(state) == "Answer:"  # the longest clean prefix: nothing
    with pytest.raises(ValueError):
        state.value  # the constraint is not complete


def test_beam_search_with_bans_is_refused(model):
    with pytest.raises(ValueError, match="beam search"):
        generate.text(model, samplers.beam_search(2), ban=["x"])
