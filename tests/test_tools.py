"""generate.tools: free text and calls held to the tools' schemas, in the model's own format."""

from typing import Literal

import pytest
import torch
from pydantic import BaseModel, Field
from support.models import build_arch
from support.templates import QWEN25

from continuous import Reply, ToolCall, chat, continuous, generate, models, samplers
from continuous.engines import bits
from continuous.engines.tools import HERMES


class Add(BaseModel):
    """Add two numbers."""

    a: int = Field(ge=0, le=99)
    b: int = Field(ge=0, le=99)


def switch(on: bool, room: Literal["kitchen", "hall"]) -> str:
    """Turn the light of a room on or off."""
    return "done"


TOOLS = [Add, switch]
NAMES = {"Add", "switch"}


def _check(reply: Reply, allowed=NAMES):
    assert isinstance(reply, Reply)
    for call in reply.calls:
        assert isinstance(call, ToolCall) and call.name in allowed
        if call.name == "Add":
            assert isinstance(call.arguments, Add)
        else:
            assert set(call.arguments) == {"on", "room"} and isinstance(call.arguments["on"], bool)
            assert call.arguments["room"] in ("kitchen", "hall")
    assert "<tool_call>" not in reply.text  # free text never holds a call's marker


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
        _check(reply)
        assert reply.calls
    auto = generate.tools(model, TOOLS)
    state = continuous(auto)([prompt] * 3, max_tokens=30, seed=1, sampler=samplers.multinomial())
    for reply in _replies(auto, state, prompt):
        _check(reply)


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
