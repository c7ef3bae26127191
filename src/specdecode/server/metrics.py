"""Prometheus metrics of the server (``GET /metrics``), in the project's vocabulary.

Per method: sequences, tokens, target forwards, draft and accepted tokens (acceptance rate =
accepted / draft), and the accepted-length histogram (one observation per verify step; its
``_sum / _count`` is the mean accepted length tau). Latency histograms: whole request, queue
wait, time to first token. Each server owns its own registry, so several servers (tests) can
live in one process.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST

from specdecode.engine import GenerationStats

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300)
ACCEPTED_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    def __init__(self):
        self.registry = registry = CollectorRegistry()
        self.requests = Counter(
            "specdecode_requests", "HTTP requests by endpoint and status code",
            ["endpoint", "status"], registry=registry)
        self.sequences = Counter(
            "specdecode_sequences", "generated sequences (one per choice) by method and outcome "
            "(stop, length, cancelled, error)", ["method", "outcome"], registry=registry)
        self.prompt_tokens = Counter(
            "specdecode_prompt_tokens", "prompt tokens of admitted requests", registry=registry)
        self.completion_tokens = Counter(
            "specdecode_completion_tokens", "generated tokens", ["method"], registry=registry)
        self.target_forwards = Counter(
            "specdecode_target_forwards", "target forward passes (prefills included)",
            ["method"], registry=registry)
        self.draft_tokens = Counter(
            "specdecode_draft_tokens", "draft tokens sent to the target", ["method"],
            registry=registry)
        self.accepted_tokens = Counter(
            "specdecode_accepted_tokens", "draft tokens accepted (bonus tokens excluded)",
            ["method"], registry=registry)
        self.accepted_length = Histogram(
            "specdecode_accepted_length", "tokens committed per verify step (accepted + 1)",
            ["method"], buckets=ACCEPTED_BUCKETS, registry=registry)
        self.latency = Histogram(
            "specdecode_request_latency_seconds", "request latency, arrival to last byte",
            ["endpoint"], buckets=LATENCY_BUCKETS, registry=registry)
        self.queue_wait = Histogram(
            "specdecode_queue_wait_seconds", "time a sequence waited for a runner slot",
            buckets=LATENCY_BUCKETS, registry=registry)
        self.first_token = Histogram(
            "specdecode_time_to_first_token_seconds", "arrival to the first generated text",
            buckets=LATENCY_BUCKETS, registry=registry)
        self.batch_size = Histogram(
            "specdecode_batch_sequences", "sequences in one target forward (decode and prompt "
            "parts together)", buckets=BATCH_BUCKETS, registry=registry)
        self.forward_rows = Histogram(
            "specdecode_forward_rows", "rows in one target forward (roots, draft nodes, prompt "
            "rows)", buckets=ROW_BUCKETS, registry=registry)
        self.prompt_cache_hit_tokens = Counter(
            "specdecode_prompt_cache_hit_tokens", "prompt tokens whose rows were reused from an "
            "earlier request or a running one (not prefilled again)", registry=registry)
        self.prompt_cache_evictions = Counter(
            "specdecode_prompt_cache_evictions", "saved prompts dropped to make room",
            registry=registry)
        self.prompt_cache_bytes = Gauge(
            "specdecode_prompt_cache_bytes", "bytes of saved prompt rows (beyond the slots' own "
            "caches)", registry=registry)
        self.prompt_cache_entries = Gauge(
            "specdecode_prompt_cache_entries", "saved prompts", registry=registry)
        self.kv_cache_bytes = Gauge(
            "specdecode_kv_cache_bytes", "bytes of a slot's KV cache now (it grows with the "
            "slot's sequence and shrinks when a new prompt starts)", ["slot"], registry=registry)
        self.queued = Gauge("specdecode_queued_sequences", "sequences waiting for a slot",
                            registry=registry)
        self.active = Gauge("specdecode_active_sequences", "sequences being generated",
                            registry=registry)

    def observe_sequence(self, method: str, outcome: str, stats: GenerationStats | None) -> None:
        self.sequences.labels(method, outcome).inc()
        if stats is None:
            return
        self.completion_tokens.labels(method).inc(stats.new_tokens)
        self.target_forwards.labels(method).inc(stats.target_forwards)
        self.draft_tokens.labels(method).inc(stats.draft_tokens)
        self.accepted_tokens.labels(method).inc(stats.accepted_tokens)
        histogram = self.accepted_length.labels(method)
        for length in stats.accepted_lengths:
            histogram.observe(length)

    def observe_forward(self, sequences: int, rows: int) -> None:
        self.batch_size.observe(sequences)
        self.forward_rows.observe(rows)

    def watch_kv_caches(self, runners) -> None:
        """Report each runner's KV cache bytes (read when scraped) as slot 0, 1, ..."""
        for slot, runner in enumerate(runners):
            if runner.kv_bytes is not None:
                self.kv_cache_bytes.labels(str(slot)).set_function(lambda r=runner: r.kv_bytes)

    def render(self) -> bytes:
        return generate_latest(self.registry)
