"""think=: a thinking section of free text before a generator's constraint."""

import json

import pytest
from support.models import build_llama, build_tokenizer

from continuous import Think, continuous, generate, models, samplers
from continuous.engines.think import ThinkConstraint

BUDGETS = [0, 1, 3, 7]


@pytest.fixture(scope="module")
def special_model():
    """The toy model whose tokenizer has <think> and </think> as special tokens."""
    tok = build_tokenizer(1000)
    tok.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    return models.transformers(build_llama(tok, "tiny", seed=1, max_position_embeddings=512), tok)


def test_true_finds_special_markers_and_errs_clearly_without_them(model, special_model):
    made = generate.text(special_model, think=True)
    assert (made.think.open, made.think.close) == ("<think>", "</think>")
    assert generate.text(special_model, think=5).think.budget == 5
    with pytest.raises(ValueError, match=r"Think\(open=\.\.\., close=\.\.\.\)"):
        generate.json(model, {"type": "integer"}, think=True)
    with pytest.raises(TypeError, match="think must be"):
        generate.text(model, think="yes")
    with pytest.raises(ValueError, match="budget"):
        Think(budget=-1)


@pytest.mark.parametrize("budget", BUDGETS)
def test_budget_writes_close_then_the_constraint_holds(model, budget):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    gen = continuous(generate.json(model, schema, whitespace="compact", think=Think(budget=budget)))
    state = gen(["Think, then answer:", "Q:"], max_tokens=60, seed=0, sampler=samplers.multinomial())
    for r, text in enumerate(state):
        generated = text.split("<think>", 1)[1]
        thought, answer = generated.split("</think>", 1)
        assert state.reasoning[r] == thought
        assert state.value[r] == json.loads(answer)  # the value reads the text after the marker only
    thought_tokens = [len(model.tokenizer.encode(t, add_special_tokens=False)) for t in state.reasoning]
    # The budget (plus at most the few tokens that complete a character) bounds the thinking.
    assert all(n <= budget + 4 for n in thought_tokens)


def test_forced_close_is_forwarded_with_the_step(model):
    gen = continuous(generate.format(model, int, think=Think(budget=2)))
    before = model.stats.forward_calls
    state = gen("Count:", max_tokens=20)
    close_tokens = len(model.tokenizer.encode("</think>", add_special_tokens=False))
    generated = state.token_ids.shape[1] - len(model.tokenizer("Count:<think>")["input_ids"])
    # The closing marker's tokens never cost a forward each: they go with the step that sampled.
    assert model.stats.forward_calls - before < generated - close_tokens + 2
    assert isinstance(state.value, int)


def test_prompt_ending_with_open_is_not_opened_again(special_model):
    gen = continuous(generate.choice(special_model, ["yes", "no"], think=Think("<think>", "</think>", budget=4)))
    state = gen("Q: yes or no?<think>\n", max_tokens=30)
    text = str(state)
    assert text.count("<think>") == 1 and text.count("</think>") == 1
    assert state.value in ("yes", "no")
    assert state.reasoning[0] + "</think>" + state.value == text.split("<think>\n", 1)[1]


def test_special_close_token_ends_the_section(special_model):
    close = special_model.tokenizer.convert_tokens_to_ids("</think>")
    gen = continuous(generate.regex(special_model, r"[a-c]{2}", think=3))
    state = gen(["A", "B"], max_tokens=20, seed=3, sampler=samplers.multinomial())
    for r in range(2):
        ids = state.token_ids[r].tolist()
        assert ids.count(close) == 1
        assert len(state.value[r]) == 2 and set(state.value[r]) <= set("abc")


def test_stream_pieces_say_their_kind(model):
    gen = continuous(generate.format(model, int, think=Think(budget=3)))
    stream = gen.stream("N:", max_tokens=30)
    pieces = list(stream)
    assert "".join(pieces) == str(stream.state)[len("N:<think>"):]
    kinds = [p.kind for p in pieces]
    assert set(kinds) <= {"reasoning", "answer"}
    assert kinds == sorted(kinds, key=lambda k: k == "answer")  # reasoning first, then answer
    assert "".join(p.reasoning for p in pieces) == stream.state.reasoning[0]
    assert "".join(p.answer for p in pieces) == str(stream.state.value)


def test_matcher_rollback_and_copy_cross_the_marker(model):
    tok = model.tokenizer
    inner = generate.format(model, int).constraint
    constraint = ThinkConstraint(inner, tok, Think(budget=None))
    ids = tok.encode("abc</think>12", add_special_tokens=False)
    m = constraint.matcher()
    for t in ids:
        m.advance(t)
    assert m.accepting()
    copy = m.copy()
    n_answer = len(tok.encode("12", add_special_tokens=False))
    m.rollback(n_answer + 2)  # back inside the thinking section
    assert not m.accepting()
    for t in ids[len(ids) - n_answer - 2:]:
        m.advance(t)
    assert m.accepting() and copy.accepting()


def test_a_continuation_without_thinking_has_no_reasoning(model):
    state = continuous(generate.format(model, int, think=Think(budget=2)))("x", max_tokens=20)
    assert state.reasoning[0] is not None
    more = continuous(generate.format(model, int))(state + " and ", max_tokens=8)
    assert more.reasoning is None and isinstance(more.value, int)
    assert str(more).startswith(str(state))


def test_a_state_is_opened_per_row_and_only_new_tokens_are_forwarded(model):
    gen = continuous(generate.format(model, int, think=Think(budget=3)))
    first = gen(["A:", "B:<think>"], max_tokens=20)
    assert [t.count("<think>") for t in first] == [1, 1]
    before = model.stats.tokens_forwarded
    second = gen(first + "\nAgain:", max_tokens=20)
    assert [t.count("<think>") for t in second] == [2, 2]
    spent = model.stats.tokens_forwarded - before
    new = second.token_ids.shape[1] - first.token_ids.shape[1]
    assert spent <= 2 * (new + 1)  # each row's new tokens (and its last unforwarded one), not its history
    assert all(isinstance(v, int) for v in second.value)


# Budget 6: cuts inside the thinking, where the budget runs out, and (for the text
# markers, 6 tokens long) inside the closing marker that the budget writes.
@pytest.mark.parametrize("markers, cut", [("text", 1), ("text", 4), ("text", 6), ("text", 7), ("text", 9),
                                          ("text", 11), ("special", 1), ("special", 4), ("special", 6)])
def test_a_state_cut_inside_its_thinking_goes_on_with_it_and_the_budget_left(model, special_model, markers, cut):
    m = model if markers == "text" else special_model
    gen = continuous(generate.regex(m, "[0-9]{1,3}", think=Think(budget=6)))
    whole = gen(["Count:", "N:"], max_tokens=40)
    assert whole.finish_reasons == ["eos", "eos"]
    first = gen(["Count:", "N:"], max_tokens=cut)
    assert all(str(text).count("</think>") == 0 for text in first)  # cut inside the section
    rest = gen(first, max_tokens=40 - cut)
    assert list(rest) == list(whole)  # one "<think>", and the budget counts what the first call thought
    assert rest.value == whole.value
    for r in range(2):  # (the first call may end inside a character: its text does not add up)
        assert whole.reasoning[r].endswith(rest.reasoning[r])


def test_a_prompt_that_began_its_thinking_counts_what_it_holds_against_the_budget(special_model):
    gen = continuous(generate.regex(special_model, "[0-9]{1,3}", think=Think(budget=4)))
    tok = special_model.tokenizer
    for thoughts in [" one two three four five", " one"]:
        assert (len(tok.encode(thoughts, add_special_tokens=False)) > 4) == (thoughts != " one")
        state = gen("Q:<think>" + thoughts, max_tokens=40)
        assert str(state).startswith("Q:<think>" + thoughts) and str(state).count("<think>") == 1
        thought = len(tok.encode(state.reasoning[0], add_special_tokens=False))
        if thoughts == " one":
            assert 0 < thought <= 4 - 1 + 3  # what is left (a character may need a few more)
        else:
            assert state.reasoning[0] == ""  # the budget was spent: the section ends at once
        assert state.value.isdigit()


def test_an_opening_marker_before_a_special_token_was_text_and_the_answer_thinks_anew(special_model):
    gen = continuous(generate.regex(special_model, "[0-9]{1,3}", think=Think(budget=4)))
    eos = special_model.tokenizer.eos_token
    prompt = f"User: what does <think> mean?{eos}Assistant:"
    state = gen(prompt, max_tokens=30)
    assert str(state).startswith(prompt + "<think>") and str(state).count("</think>") == 1
    thought = special_model.tokenizer.encode(state.reasoning[0], add_special_tokens=False)
    assert state.value.isdigit() and 0 < len(thought) <= 4 + 3


def test_what_the_grammar_cannot_enforce_is_watched_after_the_section_only(model):
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 3}, "uniqueItems": True,
              "minItems": 2, "maxItems": 3}
    made = generate.json(model, schema, whitespace="compact", think=Think(budget=4))
    assert "uniqueItems" in made.constraint.dropped and made.constraint.watch() is not None
    state = continuous(made)(["List:", "Numbers:"], max_tokens=60, seed=1, sampler=samplers.multinomial())
    for value in state.value:
        assert len(set(value)) == len(value)


@pytest.mark.slow
def test_smollm2_thinks_within_its_budget_then_answers_in_json():
    from support.real import smollm2

    from continuous import chat

    model = models.transformers(str(smollm2()))
    with pytest.raises(ValueError, match="Think"):
        generate.text(model, think=True)  # SmolLM2 has no thinking markers
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
              "required": ["city"], "additionalProperties": False}
    gen = continuous(generate.json(model, schema, think=Think(budget=24)))
    prompt = chat.prompt(model, [{"role": "user", "content": "Which city is the capital of France? Think, then "
                                  "answer in JSON."}])
    state = gen(prompt, max_tokens=80)
    assert len(model.tokenizer.encode(state.reasoning[0], add_special_tokens=False)) <= 24 + 4
    assert set(state.value) == {"city"}
    assert "</think>" not in json.dumps(state.value)


@pytest.mark.slow
@pytest.mark.real
def test_smollm2_cut_while_thinking_goes_on_with_its_section_and_budget():
    from support.real import smollm2

    from continuous import chat

    model = models.transformers(str(smollm2()))
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
              "additionalProperties": False}
    gen = continuous(generate.json(model, schema, think=Think(budget=16)))
    prompt = chat.prompt(model, [{"role": "user", "content": "Which city is the capital of Italy? Think, then "
                                  "answer in JSON."}])
    whole = gen(prompt, max_tokens=80)
    assert whole.finish_reasons == ["eos"]
    for cut in (5, 17, 18):  # inside the thinking, and twice inside the closing marker the budget writes
        first = gen(prompt, max_tokens=cut)
        assert "</think>" not in str(first)
        rest = gen(first, max_tokens=80 - cut)
        assert str(rest) == str(whole) and str(rest).count("<think>") == 1
        assert rest.value == whole.value and set(rest.value) == {"city"}
