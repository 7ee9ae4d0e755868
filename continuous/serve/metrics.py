"""``/metrics``: what operators graph, in Prometheus' text format (``prometheus_client``).

Each application has a registry of its own (two apps in one process do not mix their
counts). Besides the server's own request and token counts and latencies, every number
in the model's ``stats`` is exported as ``continuous_model_<name>`` (read by name, so that
counters a backend adds show up), and the prefix cache's size as ``continuous_prefix_cache_*``.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

__all__ = ["Metrics", "Tracked", "add_metrics_route"]

#: Seconds: time to first token (a prefill may wait behind others), and per output token.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass
class Tracked:
    """A request in flight: its call, its stream and when it was admitted."""

    call: object
    stream: object
    admitted: float


class Metrics:
    """The metrics of one served model.

    Parameters
    ----------
    served
        The :class:`~continuous.serve.calls.Served` model: its requests in flight, its model's
        ``stats`` and prefix cache.
    """

    def __init__(self, served):
        self.served = served
        self.registry = registry = CollectorRegistry()
        self._tracked: dict[int, Tracked] = {}
        Gauge("continuous_requests_running", "Requests generating (their first token came)",
              registry=registry).set_function(lambda: self.running)
        Gauge("continuous_requests_waiting", "Requests admitted whose first token has not come yet (prefill)",
              registry=registry).set_function(lambda: max(served.in_flight - self.running, 0))
        self.rejected = Counter("continuous_requests_rejected", "Requests refused because the queue was full (429)",
                                registry=registry)
        self.finished = Counter("continuous_requests_finished", "Requests answered (or whose client left)",
                                registry=registry)
        self.prefilled = Counter("continuous_prompt_tokens_prefilled",
                                 "Prompt tokens forwarded (of requests that got a first token)", registry=registry)
        self.cached = Counter("continuous_prompt_tokens_cached", "Prompt tokens the prefix cache supplied",
                              registry=registry)
        self.generated = Counter("continuous_generation_tokens", "Tokens generated", registry=registry)
        self.ttft = Histogram("continuous_time_to_first_token_seconds", "From admission to the first token",
                              buckets=TTFT_BUCKETS, registry=registry)
        self.tpot = Histogram("continuous_time_per_output_token_seconds",
                              "After the first token, seconds per token of the longest choice",
                              buckets=TPOT_BUCKETS, registry=registry)
        registry.register(_ModelCollector(served.model))

    @property
    def running(self) -> int:
        return sum(1 for t in self._tracked.values() if t.stream.first_piece_at is not None)

    def track(self, call, stream) -> Tracked:
        """Count a request admitted with its started ``stream`` (call :meth:`done` once it ends)."""
        tracked = Tracked(call, stream, time.monotonic())
        self._tracked[id(tracked)] = tracked
        return tracked

    def done(self, tracked: Tracked) -> None:
        """Count what a request did: its tokens and its latencies."""
        if self._tracked.pop(id(tracked), None) is None:
            return
        end, call, stream = time.monotonic(), tracked.call, tracked.stream
        self.finished.inc()
        first = stream.first_piece_at
        if first is None:  # ended before its first token: reading its state could start the call now
            return
        state = stream.state
        prompts = [call.prompt_tokens[r // call.n] for r in range(len(call.prompts) * call.n)]
        generated = [max(total - prompt, 0) for total, prompt in zip(state.attention_mask.sum(1).tolist(), prompts)]
        self.cached.inc(state.tokens_cached)
        self.prefilled.inc(max(sum(call.prompt_tokens) - state.tokens_cached, 0))
        self.generated.inc(sum(generated))
        self.ttft.observe(first - tracked.admitted)
        if max(generated, default=0) > 1:
            self.tpot.observe((end - first) / (max(generated) - 1))

    def render(self) -> bytes:
        """Every metric, in Prometheus' text format."""
        return generate_latest(self.registry)


def add_metrics_route(app, served) -> None:
    """Serve ``GET /metrics`` on ``app``: ``served.metrics`` in Prometheus' text format."""
    from fastapi.responses import Response

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(served.metrics.render(), media_type=CONTENT_TYPE_LATEST)


class _ModelCollector:
    """The model's ``stats`` (every public number, by name) and its prefix cache's size, read at each scrape."""

    def __init__(self, model):
        self.model = model

    def describe(self):
        return []  # read at each scrape: the names are the stats' own

    def collect(self):
        stats = self.model.stats
        names = [f.name for f in dataclasses.fields(stats)] if dataclasses.is_dataclass(stats) else list(vars(stats))
        # and its averages (rows_per_step, host_ms_per_step...): properties of its class
        names += [n for n in dir(type(stats)) if isinstance(getattr(type(stats), n), property) and n not in names]
        for name in names:
            value = getattr(stats, name, None)
            if name.startswith("_") or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            yield GaugeMetricFamily(f"continuous_model_{name}", f"model.stats.{name}", value=value)
        kept = self.model.prefix_cache
        if kept is not None:
            yield GaugeMetricFamily("continuous_prefix_cache_bytes", "Bytes the prefix cache holds", value=kept.bytes)
            yield GaugeMetricFamily("continuous_prefix_cache_max_bytes", "The prefix cache's budget",
                                    value=kept.max_bytes)
            yield GaugeMetricFamily("continuous_prefix_cache_entries", "States the prefix cache holds",
                                    value=len(kept))
