"""generate.tools: free text and calls held to the tools' schemas, in the model's own format."""

import json
from typing import Literal

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, Field
from support.constraints import accepts
from support.models import build_arch
from support.serving import TEMPLATE
from support.templates import QWEN25

from continuous import Reply, ToolCall, chat, continuous, generate, models, samplers
from continuous.engines import bits
from continuous.engines.tools import HERMES, LLAMA3, MISTRAL, read_calls


class Add(BaseModel):
    """Add two numbers."""

    a: int = Field(ge=0, le=99)
    b: int = Field(ge=0, le=99)


def switch(on: bool, room: Literal["kitchen", "hall"]) -> str:
    """Turn the light of a room on or off."""
    return "done"


TOOLS = [Add, switch]
NAMES = {"Add", "switch"}


def _check(reply: Reply, allowed=NAMES, form=HERMES):
    assert isinstance(reply, Reply)
    for call in reply.calls:
        assert isinstance(call, ToolCall) and call.name in allowed
        if call.name == "Add":
            assert isinstance(call.arguments, Add)
        else:
            assert set(call.arguments) == {"on", "room"} and isinstance(call.arguments["on"], bool)
            assert call.arguments["room"] in ("kitchen", "hall")
    # Free text never holds what opens a call in the form: a marker, or (Llama 3.1) a leading "{".
    if form is LLAMA3:
        assert not reply.text.lstrip().startswith("{")
    else:
        assert form.open not in reply.text


def _replies(made, state, prompt):
    """Each row's reply, parsed by the generator (a random model's free text may end inside a
    character when max_tokens cuts it, which ``value`` refuses as incomplete)."""
    return [made.parse(text[len(prompt):]) for text in state]


def _sample(model, choice, prompt, n=4, tokens=80):
    made = generate.tools(model, TOOLS, tool_choice=choice)
    state = continuous(made)([prompt] * n, max_tokens=tokens, seed=0, sampler=samplers.multinomial())
    return _replies(made, state, prompt)


@pytest.mark.parametrize("choice", ["required", "Add", "switch"])
def test_forced_calls_parse_and_name_a_real_tool(model, choice):
    for reply in _sample(model, choice, "Call:"):
        _check(reply, NAMES if choice == "required" else {choice})
        assert reply.calls  # a call comes first


def test_auto_text_stays_free_and_calls_parse(model):
    gen = generate.tools(model, TOOLS)
    row = torch.zeros(bits.words(len(model.tokenizer)), dtype=torch.int32)
    gen.constraint.matcher().fill(row)
    allowed = int(bits.unpack(row[None], len(model.tokenizer)).sum())
    # Outside a call every token is allowed but those that do not start a character (bytes
    # of a multi-byte character left to complete) and EOS's: the text is the model's own.
    assert allowed >= 0.8 * len(model.tokenizer)
    state = continuous(gen)(["Hi"] * 4, max_tokens=30, seed=0, sampler=samplers.multinomial())
    for reply in _replies(gen, state, "Hi"):
        _check(reply)


def test_none_is_free_text(model):
    gen = generate.tools(model, TOOLS, tool_choice="none")
    assert gen.constraint is None
    state = continuous(gen)("Hi", max_tokens=10)
    assert state.value == Reply(str(state)[2:].strip(), [])


def test_bad_tools_are_refused(model):
    with pytest.raises(ValueError, match="tool_choice"):
        generate.tools(model, TOOLS, tool_choice="delete")
    with pytest.raises(ValueError, match="non-empty"):
        generate.tools(model, [])
    with pytest.raises(TypeError, match="function or a pydantic"):
        generate.tools(model, [42])
    with pytest.raises(TypeError, match="continuous.models"):
        generate.tools("some/model", TOOLS)


@pytest.fixture(scope="module")
def qwen():
    hf, tok = build_arch("qwen2", seed=0, max_position_embeddings=1024)
    tok.chat_template = QWEN25
    return models.transformers(hf, tok)


def test_qwen_template_renders_tools_and_calls_continue_with_only_new_tokens(qwen):
    gen = generate.tools(qwen, TOOLS, tool_choice="required")
    assert gen.own_format
    messages = [{"role": "user", "content": "Add 2 and 3."}]
    prompt = gen.prompt(messages)
    assert "<tools>" in prompt and '"name": "Add"' in prompt
    call = continuous(gen)
    state = call(prompt, max_tokens=80, seed=0, sampler=samplers.multinomial())
    reply = _replies(gen, state, prompt)[0]
    _check(reply)
    assert reply.calls
    answer = str(state)[len(prompt):]
    after = messages + [{"role": "assistant", "content": answer}, {"role": "tool", "content": "5"}]
    text = gen.prompt(after)
    assert text.startswith(str(state))
    before = qwen.stats.tokens_forwarded
    auto = generate.tools(qwen, TOOLS)
    cont = continuous(auto)(chat.sync(state, text), max_tokens=5)
    spent = qwen.stats.tokens_forwarded - before
    new = len(qwen.tokenizer(text)["input_ids"]) - state.token_ids.shape[1]
    # The history is not forwarded again: the new turn's tokens, the last generated one, the answer.
    assert spent <= new + 1 + 5
    _check(_replies(auto, cont, text)[0])


@pytest.mark.slow
def test_smollm2_default_format_calls_parse():
    from support.real import smollm2

    model = models.transformers(str(smollm2()))
    gen = generate.tools(model, TOOLS)
    assert not gen.own_format
    prompt = gen.prompt([{"role": "user", "content": "Please add 12 and 30 with the Add tool."}])
    assert "<tool_call>" in prompt and "Add" in prompt
    state = continuous(gen)(prompt, max_tokens=60)
    _check(state.value)
    forced = continuous(generate.tools(model, TOOLS, tool_choice="Add"))(prompt, max_tokens=60)
    assert forced.value.calls and forced.value.calls[0].name == "Add"


def test_special_token_markers_are_matched_as_tokens():
    from support.models import build_llama, build_tokenizer

    tok = build_tokenizer(1000)
    tok.add_special_tokens({"additional_special_tokens": [HERMES.open, HERMES.close]})
    model = models.transformers(build_llama(tok, "tiny", seed=2, max_position_embeddings=512), tok)
    made = generate.tools(model, TOOLS, tool_choice="required")
    state = continuous(made)(["Go:", "Now:"], max_tokens=60, seed=0, sampler=samplers.multinomial())
    opening = tok.convert_tokens_to_ids(HERMES.open)
    for r, prompt in enumerate(["Go:", "Now:"]):
        assert state.token_ids[r].tolist().count(opening) >= 1  # the marker is its special token
        reply = made.parse(list(state)[r][len(prompt):])
        _check(reply)
        assert reply.calls


def test_tools_after_a_thinking_section(model):
    from continuous import Think

    made = generate.tools(model, TOOLS, tool_choice="required", think=Think(budget=3))
    state = continuous(made)(["Plan:", "Act:"], max_tokens=90, seed=0, sampler=samplers.multinomial())
    for r, prompt in enumerate(["Plan:", "Act:"]):
        generated = list(state)[r][len(prompt + "<think>"):]
        reply = made.parse(generated)
        _check(reply)
        assert reply.calls and generated.index("</think>") < generated.index("<tool_call>")
        assert "<tool_call>" not in state.reasoning[r]


def test_a_tool_without_docstring_has_no_description(model):
    class Ping(BaseModel):
        host: str

    made = generate.tools(model, [Ping])
    assert made.tools[0].description == "" and made.tools[0].parameters["additionalProperties"] is False


@pytest.mark.parametrize("template, form", [("LLAMA31_FORM", "llama3"), ("MISTRAL_FORM", "mistral")])
def test_other_template_forms_are_followed(template, form):
    from support import templates
    from support.models import build_llama, build_tokenizer

    tok = build_tokenizer(1000)
    tok.chat_template = getattr(templates, template)
    model = models.transformers(build_llama(tok, "tiny", seed=3, max_position_embeddings=2048), tok)
    required = generate.tools(model, TOOLS, tool_choice="required")
    assert required.own_format and required.form.name == form
    prompt = required.prompt([{"role": "user", "content": "Add 1 and 2."}])
    assert '"Add"' in prompt and '"switch"' in prompt
    state = continuous(required)([prompt] * 4, max_tokens=100, seed=0, sampler=samplers.multinomial())
    # A list of calls (Mistral) may go on past max_tokens on a random model: rows whose call ended parse.
    ended = [r for r, why in enumerate(state.finish_reasons) if why == "eos"]
    assert ended
    for r in ended:
        reply = required.parse(list(state)[r][len(prompt):])
        _check(reply, form=required.form)
        assert reply.calls
    auto = generate.tools(model, TOOLS)
    state = continuous(auto)([prompt] * 3, max_tokens=30, seed=1, sampler=samplers.multinomial())
    for reply in _replies(auto, state, prompt):
        _check(reply, form=auto.form)


def test_openai_style_tool_dicts(model):
    spec = {"type": "function", "function": {"name": "lamp", "description": "Switch the lamp.", "parameters": {
        "type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"],
        "additionalProperties": False}}}
    made = generate.tools(model, [spec, Add], tool_choice="lamp")
    assert made.tools[0].description == "Switch the lamp."
    state = continuous(made)(["Go:", "Now:"], max_tokens=80, seed=0, sampler=samplers.multinomial())
    for r, prompt in enumerate(["Go:", "Now:"]):
        reply = made.parse(list(state)[r][len(prompt):])
        assert reply.calls and all(c.name == "lamp" and isinstance(c.arguments["on"], bool) for c in reply.calls)
    with pytest.raises(ValueError, match="needs a function with a name"):
        generate.tools(model, [{"type": "function", "function": {"description": "no name"}}])


def _formed(template: str, seed: int = 3):
    """A tiny model whose chat template asks for calls in ``template``'s form."""
    from support import templates
    from support.models import build_llama, build_tokenizer

    tok = build_tokenizer(1000)
    tok.chat_template = getattr(templates, template)
    return models.transformers(build_llama(tok, "tiny", seed=seed, max_position_embeddings=2048), tok)


@pytest.fixture(scope="module")
def llama_form():
    return _formed("LLAMA31_FORM")


def test_a_hermes_string_argument_may_hold_the_closing_marker(model):
    spec = {"type": "function", "function": {"name": "say", "parameters": {
        "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}
    made = generate.tools(model, [spec], tool_choice="auto")
    said = 'a</tool_call>b <tool_call> "c"'
    text = f'Sure. <tool_call>{{"name": "say", "arguments": {json.dumps({"text": said})}}}</tool_call> Done.'
    assert accepts(made, text)  # the grammar allows it: the parse must read it as written
    assert made.parse(text) == Reply("Sure.  Done.", [ToolCall("say", {"text": said})])


def test_a_llama_reply_is_a_held_call_or_text_never_a_call_the_grammar_did_not_hold(llama_form):
    made = generate.tools(llama_form, TOOLS)
    assert made.form is LLAMA3
    call = '{"name": "Add", "parameters": {"a": 1, "b": 2}}'
    assert not accepts(made, ' {"x": 1}') and not accepts(made, '\n{"name": "Add", "parameters": {"a": 100}}')
    for text in (call, " " + call, "\n\n" + call):  # leading blanks, then a call held to its schema
        assert accepts(made, text)
        assert made.parse(text) == Reply("", [ToolCall("Add", Add(a=1, b=2))])
    assert accepts(made, " Hello {x}") and made.parse(" Hello {x}") == Reply("Hello {x}", [])
    # Sampled replies starting with blanks: whatever the grammar lets through parses, and fits.
    prompt = made.prompt([{"role": "user", "content": "Add 1 and 2."}])
    state = continuous(made)([prompt + " "] * 4, max_tokens=60, seed=0, sampler=samplers.multinomial())
    for r, why in enumerate(state.finish_reasons):
        if why == "eos":
            _check(made.parse(" " + list(state)[r][len(prompt) + 1:]), form=LLAMA3)


@pytest.mark.parametrize("choice", ["auto", "required", "Add"])
def test_parallel_tool_calls_false_gives_at_most_one_call(model, choice):
    made = generate.tools(model, TOOLS, tool_choice=choice, parallel_tool_calls=False)
    one = '<tool_call>{"name": "Add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    assert accepts(made, one + " done") and not accepts(made, one + one)
    assert not accepts(made, one + " and <tool_call> more")
    assert accepts(generate.tools(model, TOOLS, tool_choice=choice), one + one)
    state = continuous(made)(["Call:"] * 6, max_tokens=120, seed=0, sampler=samplers.multinomial())
    for r, text in enumerate(state):
        if state.finish_reasons[r] == "eos":
            reply = made.parse(text[len("Call:"):])
            _check(reply)
            assert len(reply.calls) <= 1 and (choice == "auto" or reply.calls)


def test_parallel_tool_calls_false_in_the_mistral_form():
    made = generate.tools(_formed("MISTRAL_FORM"), TOOLS, parallel_tool_calls=False)
    one = '{"name": "Add", "arguments": {"a": 1, "b": 2}}'
    assert accepts(made, f"Ok [TOOL_CALLS][{one}]") and not accepts(made, f"[TOOL_CALLS][{one}, {one}]")


def test_tools_are_added_to_an_existing_system_message(model, monkeypatch):
    monkeypatch.setattr(model.tokenizer, "chat_template", TEMPLATE)
    made = generate.tools(model, TOOLS)
    prompt = made.prompt([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert prompt.count("<|system|>") == 1
    assert prompt.startswith("<|system|>Be brief.\n\nYou can call tools.") and '"name": "switch"' in prompt
    alone = made.prompt([{"role": "user", "content": "Hi"}])
    assert alone.startswith("<|system|>You can call tools.") and alone.endswith("<|user|>Hi</s><|assistant|>")


def test_a_template_that_refuses_tools_gets_the_default_form(model, monkeypatch):
    refusing = "{% if tools %}{{ raise_exception('no tools here') }}{% endif %}<tool_call>" + TEMPLATE
    monkeypatch.setattr(model.tokenizer, "chat_template", refusing)
    made = generate.tools(model, TOOLS)
    assert not made.own_format and made.form is HERMES
    assert '"name": "Add"' in made.prompt([{"role": "user", "content": "Hi"}])


def test_tools_that_cannot_be_told_apart_or_read_are_refused_clearly(model):
    def Add(a: int) -> int:  # noqa: N802 (a function sharing the pydantic tool's name)
        return a

    with pytest.raises(ValueError, match="'Add' given more than once"):
        generate.tools(model, [TOOLS[0], Add])
    bad = {"type": "function", "function": {"name": "f", "parameters": ["a", "b"]}}
    with pytest.raises(ValueError, match="parameters of tool 'f' must be a JSON schema object"):
        generate.tools(model, [bad])


def test_tools_sharing_a_type_name_share_it_only_when_it_is_the_same(model):
    class Item(BaseModel):
        x: int

    class Put(BaseModel):
        item: Item

    class Take(BaseModel):
        item: Item

    same = generate.tools(model, [Put, Take])
    text = '<tool_call>{"name": "Take", "arguments": {"item": {"x": 3}}}</tool_call>'
    assert accepts(same, text) and same.parse(text).calls[0].arguments == Take(item=Item(x=3))

    class Item(BaseModel):  # noqa: F811 (the same name, another type)
        y: str

    class Give(BaseModel):
        item: Item

    with pytest.raises(ValueError, match="different types named 'Item'"):
        generate.tools(model, [Put, Give])


# Replies as the grammar writes them, for the reader's checks: text pieces, and calls whose
# string argument may hold anything (markers, quotes, braces, escapes).
_TEXT = st.text(st.sampled_from("ab <>{}[]\n"), max_size=6)
_CALLS = st.lists(st.tuples(st.sampled_from(["f", "g_2"]), st.text(st.sampled_from('ab"\\{}<>/[]\n_é'), max_size=8)),
                  max_size=3)


def _written(form, texts, calls) -> tuple[str, list[tuple[str, str]]]:
    """A reply in ``form`` and its calls' (name, arguments' JSON)."""
    wanted = [(name, json.dumps({"s": value})) for name, value in calls]
    jsons = [f'{{"name": "{name}", "{form.arguments}": {arguments}}}' for name, arguments in wanted]
    clean = [t.replace("<", "(").replace("[", "(").lstrip("{ \n") for t in texts] + [""] * 4
    if form is HERMES:
        return "".join(t + f"<tool_call>{['', chr(10)][i % 2]}{j}\n</tool_call>" for i, (t, j) in
                       enumerate(zip(clean, jsons))) + clean[len(jsons)], wanted
    if form is MISTRAL:
        return clean[0] + (f"[TOOL_CALLS][{', '.join(jsons)}]" if jsons else ""), wanted
    return (" " + jsons[0], wanted[:1]) if jsons else ("x" + clean[0], [])


@settings(max_examples=150, deadline=None)
@given(st.sampled_from([HERMES, MISTRAL, LLAMA3]), st.lists(_TEXT, max_size=4), _CALLS)
def test_a_reply_read_as_it_is_written_only_grows_into_the_whole_reply(form, texts, calls):
    reply, wanted = _written(form, texts, calls)
    whole = read_calls(reply, form)
    assert [(c.name, c.arguments) for c in whole.calls] == wanted and all(c.done for c in whole.calls)
    assert form.open not in whole.text if form is not LLAMA3 else not whole.text.lstrip().startswith("{")
    for end in range(len(reply) + 1):
        part = read_calls(reply[:end], form, final=False)
        assert whole.text.startswith(part.text)
        assert len(part.calls) <= len(whole.calls)
        for seen, call in zip(part.calls, whole.calls):
            assert seen.name in (None, call.name) and call.arguments.startswith(seen.arguments)
            assert not seen.done or seen == call
            assert seen.name is not None or not seen.arguments
