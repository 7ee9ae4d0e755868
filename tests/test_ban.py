"""ban=: detection against brute force, rewinds, and the loop's guarantees."""

import warnings

import pytest
import regex
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support.states import assert_equivalent, real_ids

from continuous import BanExhausted, continuous, generate, samplers
from continuous.ban import BanList
from continuous.engines import Match

ALPHABET = "abcAB "
phrases_st = st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=4), min_size=1, max_size=6)


def pieces(text, cuts):
    cuts = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in zip(cuts, cuts[1:])]


def word(c):
    return c.isalnum() or c == "_"


def all_matches(phrases, text):
    """Brute force: every (start, factor) of a phrase on word boundaries, the text's end being one."""
    low = text.lower()
    found = set()
    for p in phrases:
        q = p.lower()
        for i in range(len(low) - len(q) + 1):
            if low[i:i + len(q)] != q:
                continue
            if word(q[0]) and i > 0 and word(low[i - 1]):
                continue
            if word(q[-1]) and i + len(q) < len(low) and word(low[i + len(q)]):
                continue
            found.add(Match(i, i + len(q)))
    return sorted(found, key=lambda m: (m.start, m.end))


@settings(max_examples=200, deadline=None)
@given(phrases=phrases_st, text=st.text(alphabet=ALPHABET, max_size=20), cuts=st.lists(st.integers(0, 20)))
def test_every_match_on_word_boundaries_is_found_whatever_the_pieces(phrases, text, cuts):
    matcher = BanList(phrases).matcher()
    found = []
    for piece in pieces(text, cuts):
        found += matcher.feed(piece)
    found += matcher.finish()
    assert sorted(set(found), key=lambda m: (m.start, m.end)) == all_matches(phrases, text)


def test_a_phrase_matches_whole_words_only():
    matcher = BanList(["a", "the end"]).matcher()
    assert matcher.feed("banana, a") == []  # "a" ends the text: the next character decides
    assert matcher.held() == 1
    assert matcher.feed("n") == []  # "an": not the word "a"
    assert matcher.feed(" a ") == [Match(11, 12)]
    assert matcher.feed("the end") == [] and matcher.finish() == [Match(13, 20)]
    after = BanList(["a"]).matcher(before="Mam")
    assert after.feed("a b") == []  # the text before the generated text counts: "Mama"


def test_a_ban_nested_in_a_soft_one_is_found_too():
    matcher = BanList({"om": 0.9, "omar": 0}).matcher()
    assert matcher.feed("omar ") == [Match(0, 4)]  # "om" is no whole word here
    matcher = BanList({"om ar": 0.9, "om": 0}).matcher()
    assert matcher.feed("om ar ") == [Match(0, 2), Match(0, 5, 0.9)]  # both, the ban first


def test_case_folding_is_unicode_case_folding():
    assert BanList(["ΟΔΟΣ"]).matcher().feed("η οδος.") == [Match(2, 6)]
    assert BanList(["straße"]).matcher().feed("die STRASSE.") == []  # no per-character folding of ß


def test_a_pattern_that_looks_past_its_match_waits_for_more_text():
    for pattern, later, kills in [(r"foo\b", "d", " "), (r"foo$", "d", None), (r"foo(?!d)", "d", "l")]:
        matcher = BanList([regex.compile(pattern)]).matcher()
        assert matcher.feed("a foo") == [] and matcher.held() >= 3, pattern
        twin = matcher.copy()
        assert matcher.feed(later) == []  # "food": no match
        if kills is not None:
            assert twin.feed(kills) == [Match(2, 5)], pattern
        else:
            assert twin.finish() == [Match(2, 5)]


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
    assert matcher.feed("it is not") == [] and matcher.held() == 3
    assert matcher.feed(" this") == [] and matcher.held() == len("not this")
    assert matcher.feed(" but that") == [Match(6, 18)]


def test_case_and_soft_factors():
    assert BanList(["Tapestry"]).matcher().feed("a TAPESTRY.") == [Match(2, 10)]
    assert BanList(["Tapestry"], case_sensitive=True).matcher().feed("a TAPESTRY.") == []
    assert BanList({"tapestry": 0.5}).matcher().feed("tapestry ") == [Match(0, 8, 0.5)]


@pytest.mark.parametrize("bad, error", [([""], ValueError), ("tapestry", TypeError), ([3], TypeError),
                                        ({"x": 1.5}, ValueError), ({"x": -1}, ValueError)])
def test_bad_ban_lists_are_refused(bad, error):
    with pytest.raises(error):
        BanList(bad)


# ------------------------------------------------------------------ in the decoding loop
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
        assert not all_matches(banned, v)
    if sampler.samples == 1 and not hasattr(sampler, "temperature"):  # greedy redoes the free run: it rewound
        assert model.stats.tokens_rewound > before["tokens_rewound"]
    streamed = []
    stream = gen.stream(prompt, max_tokens=24, seed=3)
    for piece in stream:
        streamed.append(piece)
    rows = list(zip(*streamed)) if isinstance(streamed[0], list) else [streamed]
    for r, row in enumerate(rows):
        assert "".join(row) == values[r]  # nothing streamed was taken back
        assert not all_matches(banned, "".join(row))


def test_a_rewound_state_equals_its_recomputation_and_weights_are_masked_logprobs(model, hf_model):
    prompt = "User: Tell me about Omar.\nAssistant:"
    banned, _ = banned_from_a_free_run(model, prompt)
    state = continuous(generate.text(model, ban=banned))(prompt, max_tokens=20)
    text = continuous(generate.text(model))
    assert_equivalent(text, state, n=5)
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
    gen = continuous(generate.choice(model, ["alpha", "alps"], ban=[regex.compile("al")]))
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


def test_a_match_in_forced_tokens_backs_up_to_the_sampled_token(model):
    for fast_forward in (True, False):
        gen = continuous(generate.choice(model, ["Zanzibar", "Paris"], ban=[regex.compile("ibar")]), fast_forward=fast_forward)
        with warnings.catch_warnings():
            warnings.simplefilter("error", BanExhausted)
            assert gen("City:").value == "Paris"


def test_a_streamed_piece_is_never_taken_back_by_a_rewind_to_its_token(model):
    """A match may start inside a token: the whole token's text is held back, not only the match's."""
    prompt = "User: Tell me about Omar.\nAssistant:"
    free = continuous(generate.text(model))(prompt, max_tokens=24).value
    tokens = model.tokenizer(free, add_special_tokens=False).input_ids
    pieces = [model.tokenizer.decode(tokens[: i + 1]) for i in range(len(tokens))]
    # A pattern that starts in the middle of a token of the free run.
    long = next(i for i in range(1, len(pieces)) if len(pieces[i]) - len(pieces[i - 1]) >= 3)
    start = len(pieces[long - 1]) + 1
    banned = regex.compile(regex.escape(free[start:start + 3]))
    gen = continuous(generate.text(model, ban=[banned]))
    streamed = "".join(gen.stream(prompt, max_tokens=24))
    assert streamed == gen(prompt, max_tokens=24).value


def test_a_phrase_whose_tokens_were_all_forced_rewinds_to_the_choice_that_made_it_whole(model):
    # "City: Paris" is forced once "C" is sampled: the last real choice is to end after "Paris".
    for make in (lambda: generate.regex(model, r"City: (Paris|Parisian)", ban=["Paris"]),
                 lambda: generate.choice(model, ["City: Paris", "City: Parisian"], ban=["Paris"]),
                 lambda: generate.choice(model, ["Paris", "Parisian"], ban=["Paris"])):
        for fast_forward in (True, False):
            with warnings.catch_warnings():
                warnings.simplefilter("error", BanExhausted)
                state = continuous(make(), fast_forward=fast_forward)("Where?")
            assert state.value.endswith("Parisian") and state.finish_reasons == ["eos"]
