"""``/metrics``: requests, tokens, latencies and the model's stats, parsed with prometheus_client's parser."""

from __future__ import annotations

import asyncio
import dataclasses

import openai
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from support.serving import NAME, in_process

from continuous.models.base import Stats
from continuous.serve import build_app
from continuous.serve.wire import CompletionRequest

PROMPT = "User: Tell me about Alice.\nAssistant:"


def scrape(http) -> dict[str, float]:
    """Every sample of ``/metrics`` by its name (and labels), parsed as Prometheus parses it."""
    answer = http.get("/metrics")
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(answer.text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return out


def grew(before: dict, after: dict, name: str) -> float:
    return after[name] - before.get(name, 0.0)


@pytest.fixture(scope="module")
def app(chat_model):
    return build_app(chat_model, name=NAME)


def test_a_request_counts_its_tokens_and_latencies(app, chat_model):
    with TestClient(app) as http, in_process(app) as client:
        before = scrape(http)
        answer = client.completions.create(model=NAME, prompt=[PROMPT, PROMPT + " Hi"], n=2, max_tokens=8, seed=1)
        after = scrape(http)
    usage = answer.usage
    assert grew(before, after, "continuous_generation_tokens_total") == usage.completion_tokens > 0
    cached = usage.prompt_tokens_details.cached_tokens
    assert grew(before, after, "continuous_prompt_tokens_cached_total") == cached
    assert grew(before, after, "continuous_prompt_tokens_prefilled_total") == usage.prompt_tokens - cached
    assert grew(before, after, "continuous_requests_finished_total") == 1
    assert grew(before, after, "continuous_time_to_first_token_seconds_count") == 1
    assert grew(before, after, "continuous_time_per_output_token_seconds_count") == 1
    assert after["continuous_time_to_first_token_seconds_bucket{le=+Inf}"] == \
        after["continuous_time_to_first_token_seconds_count"]
    assert after["continuous_requests_running"] == after["continuous_requests_waiting"] == 0
    stats = chat_model.stats
    assert after["continuous_model_forward_calls"] == stats.forward_calls
    assert after["continuous_model_tokens_cached"] == stats.tokens_cached
    assert after["continuous_prefix_cache_max_bytes"] == chat_model.prefix_cache.max_bytes
    assert after["continuous_prefix_cache_bytes"] == chat_model.prefix_cache.bytes > 0


def test_a_stream_counts_as_the_whole_answer(app):
    with TestClient(app) as http, in_process(app) as client:
        before = scrape(http)
        chunks = list(client.completions.create(model=NAME, prompt=PROMPT, max_tokens=6, temperature=0, stream=True,
                                                stream_options={"include_usage": True}))
        after = scrape(http)
    assert grew(before, after, "continuous_generation_tokens_total") == chunks[-1].usage.completion_tokens
    assert grew(before, after, "continuous_time_to_first_token_seconds_count") == 1


def test_requests_refused_by_a_full_queue_are_counted(chat_model):
    app = build_app(chat_model, name=NAME, max_queue=1)
    served = app.state.served
    with TestClient(app) as http, in_process(app) as client:
        served.admit()  # the queue's one place is taken
        try:
            for _ in range(2):
                with pytest.raises(openai.RateLimitError):
                    client.completions.create(model=NAME, prompt=PROMPT, max_tokens=2)
        finally:
            served.release()
        metrics = scrape(http)
        assert metrics["continuous_requests_rejected_total"] == 2
        assert metrics["continuous_requests_finished_total"] == 0
        client.completions.create(model=NAME, prompt=PROMPT, max_tokens=2)
        assert scrape(http)["continuous_requests_finished_total"] == 1


def test_a_request_waits_until_its_first_token_then_runs(chat_model):
    app = build_app(chat_model, name=NAME)
    served = app.state.served

    async def steps():
        body = CompletionRequest(model=NAME, prompt=PROMPT, max_tokens=4, temperature=0)
        call = served.call([PROMPT], body, 4, None, param="prompt")
        served.admit()
        stream = call.astream()
        tracked = served.metrics.track(call, stream)
        seen = [parse(served.metrics.render())]
        await stream.__anext__()
        seen.append(parse(served.metrics.render()))
        await stream.aclose()
        served.metrics.done(tracked)
        served.release()
        return seen + [parse(served.metrics.render())]

    def parse(text: bytes) -> tuple:
        samples = {s.name: s.value for f in text_string_to_metric_families(text.decode()) for s in f.samples}
        return samples["continuous_requests_waiting"], samples["continuous_requests_running"]

    assert asyncio.run(steps()) == [(1, 0), (0, 1), (0, 0)]


def test_stats_a_backend_adds_are_exported_and_apps_keep_their_own_counts(chat_model, monkeypatch):
    @dataclasses.dataclass
    class More(Stats):
        kv_bytes_in_use: int = 4096
        host_ms_per_step: float = 1.5
        label: str = "not a number"

    monkeypatch.setattr(chat_model, "stats", More(forward_calls=7))
    one, two = build_app(chat_model, name=NAME), build_app(chat_model, name=NAME)
    with TestClient(one) as http_one, TestClient(two) as http_two, in_process(one) as client:
        client.completions.create(model=NAME, prompt=PROMPT, max_tokens=2)
        metrics = scrape(http_one)
        assert metrics["continuous_model_kv_bytes_in_use"] == 4096
        assert metrics["continuous_model_host_ms_per_step"] == 1.5
        assert not any("label" in name or "_lock" in name for name in metrics)
        assert metrics["continuous_requests_finished_total"] == 1
        assert scrape(http_two)["continuous_requests_finished_total"] == 0


def test_the_engine_s_steps_are_exported(app):
    with TestClient(app) as http, in_process(app) as client:
        client.completions.create(model=NAME, prompt=PROMPT, max_tokens=3)
        metrics = scrape(http)
    assert metrics["continuous_model_steps"] >= 3 and metrics["continuous_model_rows_per_step"] >= 1
    assert metrics["continuous_model_forward_ms_per_step"] > 0 and "continuous_model_kv_bytes_in_use" in metrics


def test_a_request_ended_before_its_first_token_counts_as_finished_and_starts_nothing(chat_model):
    app = build_app(chat_model, name=NAME)
    served = app.state.served
    body = CompletionRequest(model=NAME, prompt=PROMPT, max_tokens=4)
    call = served.call([PROMPT], body, 4, None, param="prompt")
    served.admit()
    stream = call.astream()
    before = chat_model.stats.forward_calls
    served.metrics.done(served.metrics.track(call, stream))  # a client gone before the stream began
    served.release()
    samples = {s.name: s.value for f in text_string_to_metric_families(served.metrics.render().decode())
               for s in f.samples}
    assert chat_model.stats.forward_calls == before  # the call was not started to be counted
    assert samples["continuous_requests_finished_total"] == 1 and samples["continuous_generation_tokens_total"] == 0
    assert samples["continuous_time_to_first_token_seconds_count"] == 0
