"""``/metrics`` of ``fusec serve``: Prometheus text through prometheus_client (its own registry)."""

from __future__ import annotations

from typing import Any

PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


class Metrics:
    """Prometheus metrics (prometheus_client, its own registry): requests, tokens, latencies,
    queue length, batch occupancy, decode steps and admissions."""

    def __init__(self, batcher: Any):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.reg = reg = CollectorRegistry()
        self.requests = Counter("fusec_requests", "HTTP requests by path and status", ["path", "status"],
                                registry=reg)
        self.prompt = Counter("fusec_prompt_tokens", "prompt tokens of finished requests", registry=reg)
        self.completion = Counter("fusec_completion_tokens", "tokens drawn for finished requests", registry=reg)
        self.ttft = Histogram("fusec_time_to_first_token_seconds", "request received -> first token drawn",
                              registry=reg, buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30))
        self.latency = Histogram("fusec_request_seconds", "request received -> response ended", registry=reg,
                                 buckets=(.01, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120))
        Gauge("fusec_queue_length", "requests waiting for a row", registry=reg).set_function(
            lambda: batcher.occupancy()[1])
        Gauge("fusec_batch_rows_in_use", "rows of the plan's batch serving a request", registry=reg).set_function(
            lambda: batcher.occupancy()[0])
        Gauge("fusec_batch_rows", "rows of the plan's batch", registry=reg).set(batcher.batch)
        Gauge("fusec_decode_steps", "decode steps run", registry=reg).set_function(
            lambda: batcher.counts["decode_steps"])
        Gauge("fusec_admissions", "prefills that admitted requests", registry=reg).set_function(
            lambda: batcher.counts["admissions"])

    def request(self, path: str, status: int, prompt: int, completion: int, ttft: float | None, total: float) -> None:
        known = path if path in PATHS else "other"
        self.requests.labels(known, str(status)).inc()
        self.prompt.inc(prompt)
        self.completion.inc(completion)
        if ttft is not None:
            self.ttft.observe(ttft)
        self.latency.observe(total)

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.reg), CONTENT_TYPE_LATEST
