"""From requests to library calls and back, in this process: stops held back, counts, the queue."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.streams import read_to_end

from continuous import continuous, generate, samplers
from continuous.serve.calls import FINISH, RequestError, Served, _safe, _without_stop
from continuous.serve.wire import CompletionRequest, ResponseFormat


def streamed(pieces: list[str], stops: list[str]) -> str:
    """What a client receives of ``pieces`` when each step sends what ``_safe`` allows."""
    raw, sent, out = "", 0, ""
    for piece in pieces:
        raw += piece
        safe = _safe(raw, stops)
        out += raw[sent:safe]
        sent = max(sent, safe)
    return out


def first_stop(text: str, stops: list[str]) -> int | None:
    """Where the library ends a row: the end of the first stop string it completes."""
    ends = [text.find(s) + len(s) for s in stops if s in text]
    return min(ends) if ends else None


@settings(max_examples=300, deadline=None)
@given(st.lists(st.text("ab c", max_size=4), max_size=12), st.lists(st.text("ab c", min_size=1, max_size=3),
                                                                        max_size=3))
def test_streamed_text_never_shows_a_stop_string_and_is_the_final_text_so_far(pieces, stops):
    text = "".join(pieces)
    end = first_stop(text, stops)
    if end is not None:  # the library's pieces end where the row stopped
        kept, pieces = [], list(pieces)
        for piece in pieces:
            room = end - sum(map(len, kept))
            kept.append(piece[:max(room, 0)])
        pieces, text = kept, text[:end]
    final = _without_stop(text, stops) if end is not None else text
    out = streamed(pieces, stops)
    assert final.startswith(out)
    assert not any(s in out for s in stops)
    if end is None:
        held = len(text) - len(out)
        assert held < max(map(len, stops), default=1)


def test_without_stop_takes_off_the_longest_stop_the_text_ends_with():
    assert _without_stop("hello world", ["d", "world", "x"]) == "hello "
    assert _without_stop("hello", ["x"]) == "hello"


def test_every_library_reason_has_an_openai_reason():
    assert {"eos", "stop", "length", "context", "ban_exhausted"} <= set(FINISH)
    assert set(FINISH.values()) <= {"stop", "length", "content_filter", "tool_calls"}


def request(**fields) -> CompletionRequest:
    return CompletionRequest(model="m", prompt="x", **fields)


def run_stream(call):
    async def collect():
        steps = [step async for step in call.deltas(call.astream())]
        return steps

    return asyncio.run(collect())


@pytest.mark.parametrize("n", [1, 2])
def test_a_streamed_call_gives_each_row_its_whole_text_and_one_reason(model, n):
    served = Served(model, "m", 4)
    prompts = ["User: Tell me about Bob.\nAssistant:", "Order #7"]
    free = continuous(generate.text(model, samplers.multinomial(n)))(prompts, max_tokens=10, temperature=0)
    stop = [t for row in free.value for t in (row if n > 1 else [row])][0][3:5]
    body = request(temperature=0, stop=[stop], n=n)
    whole = served.call(prompts, body, 10, None, "prompt")
    state = asyncio.run(read_to_end(whole.astream()))
    rows = whole.rows(state)
    steps = run_stream(served.call(prompts, body, 10, None, "prompt"))
    assert len(rows) == 2 * n and all(len(step) == 2 * n for step in steps)
    for r, row in enumerate(rows):
        assert "".join(step[r].text for step in steps) == row.text
        assert [step[r].finish_reason for step in steps if step[r].finish_reason] == [row.finish_reason]
        assert stop not in row.text
    assert rows[0].finish_reason == "stop"


def test_rows_count_the_generated_tokens(model):
    served = Served(model, "m", 4)
    call = served.call(["Order #1", "User: hi"], request(temperature=0), 7, 0, "prompt")
    rows = call.rows(asyncio.run(read_to_end(call.astream())))
    assert [row.tokens for row in rows] == [len(row.logprobs) for row in rows]
    assert all(row.tokens <= 7 for row in rows)
    assert all(row.finish_reason == "length" for row in rows if row.tokens == 7)


def test_the_context_is_checked_before_any_compute(model):
    served = Served(model, "m", 4)
    forwarded = model.stats.tokens_forwarded
    with pytest.raises(RequestError) as long:
        served.call(["Paris " * model.max_length], request(), 1, None, "prompt")
    with pytest.raises(RequestError) as too_many:
        served.call(["Paris"], request(), model.max_length, None, "prompt")
    assert long.value.code == too_many.value.code == "context_length_exceeded"
    assert long.value.param == "prompt" and long.value.status == 400
    assert model.stats.tokens_forwarded == forwarded


def test_generators_are_built_once_per_format_and_n(model):
    served = Served(model, "m", 4)
    schema = ResponseFormat.model_validate({"type": "json_schema", "json_schema": {"name": "a", "schema": {
        "type": "object", "properties": {"a": {"type": "integer"}}}}})
    assert served.generator(schema, 2) is served.generator(schema, 2)
    assert served.generator(schema, 2) is not served.generator(schema, 1)
    assert served.generator(None, 1).generator.kind == "text"
    with pytest.raises(RequestError) as bad:
        served.generator(ResponseFormat.model_validate(
            {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": 3}}}), 1)
    assert bad.value.param == "response_format" and bad.value.status == 400


def test_the_queue_refuses_past_its_length_and_frees_on_release(model):
    served = Served(model, "m", 2)
    served.admit()
    served.admit()
    with pytest.raises(RequestError) as busy:
        served.admit()
    assert busy.value.status == 429 and busy.value.kind == "rate_limit_error"
    served.release()
    served.admit()
    assert served.in_flight == 2


def test_a_model_without_a_chat_template_is_told_to_use_completions(model):
    with pytest.raises(RequestError, match="/v1/completions"):
        Served(model, "m", 1).chat_prompt([{"role": "user", "content": "hi"}])


def test_messages_the_chat_template_refuses_are_a_bad_request(model, monkeypatch):
    monkeypatch.setattr(model.tokenizer, "chat_template", "{{ raise_exception('roles must alternate') }}")
    with pytest.raises(RequestError, match="roles must alternate") as refused:
        Served(model, "m", 1).chat_prompt([{"role": "user", "content": "hi"}])
    assert refused.value.status == 400 and refused.value.param == "messages"
