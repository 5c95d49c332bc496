"""What ``/metrics`` exposes in Prometheus' text format (``prometheus_client``, one registry per
server): requests running and waiting, the pool's blocks used and free, the KV bytes held now,
the KV bytes finished requests held against their full cache's, tokens, and TTFT/TPOT histograms.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ov_kvcrush.engines.base import GenerationResult

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


#: the gauges: the backend's stat, the metric, what it is
GAUGES = (
    ("running", "ovkc_requests_running", "Requests being generated"),
    ("waiting", "ovkc_requests_waiting", "Requests waiting for admission"),
    ("blocks_used", "ovkc_kv_pool_blocks_used", "KV pool blocks in use"),
    ("blocks_free", "ovkc_kv_pool_blocks_free", "KV pool blocks free (-1: unlimited pool)"),
    ("kv_bytes", "ovkc_kv_bytes_held", "KV bytes the pool holds now"),
    ("kept", "ovkc_kept_caches", "Conversations' caches kept for their next turn"),
    ("kept_blocks", "ovkc_kept_cache_blocks", "Blocks the kept caches hold"),
    ("on_disk", "ovkc_disk_caches", "Conversations' caches on disk (--cache-dir)"),
    ("on_disk_bytes", "ovkc_disk_cache_bytes", "Bytes of the caches on disk"),
)
#: the stats that count the disk's files by event (``disk_saved``, ``disk_rejected_checksum``, ...)
DISK_EVENT = "disk_"


class ServerMetrics:
    """The server's counters; the gauges read the pipeline when scraped."""

    def __init__(self, stats: Callable[[], dict[str, int]]) -> None:
        """``stats()``: the backend's gauges now, read once per scrape (a Ray backend asks each
        replica for them)."""
        self.registry = CollectorRegistry()
        r = self.registry
        self.stats = stats
        self.gauges = {key: Gauge(name, what, registry=r) for key, name, what in GAUGES}
        self.requests = Counter("ovkc_requests", "Requests answered, by outcome", ["outcome"], registry=r)
        self.prompt_tokens = Counter("ovkc_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.cached_tokens = Counter(
            "ovkc_prompt_tokens_cached", "Prompt tokens continued from a kept cache, not prefilled", registry=r
        )
        self.generated_tokens = Counter("ovkc_generated_tokens", "Tokens generated", registry=r)
        self.kv_held = Counter("ovkc_request_kv_bytes_held", "KV bytes finished requests held at their end", registry=r)
        self.kv_full = Counter(
            "ovkc_request_kv_bytes_full", "KV bytes the same requests would hold with the full cache", registry=r
        )
        self.errors = Counter("ovkc_error_responses", "Error responses sent, by HTTP status", ["status"], registry=r)
        self.disk_events = Gauge(
            "ovkc_disk_cache_files",
            "Conversation cache files since start, by event: saved, restored, evicted, rejected_<reason>",
            ["event"],
            registry=r,
        )
        self.ttft = Histogram("ovkc_ttft_seconds", "Time to first token", buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("ovkc_tpot_seconds", "Time per output token", buckets=LATENCY_BUCKETS, registry=r)

    def finished(self, result: GenerationResult, outcome: str, cached_tokens: int = 0) -> None:
        self.requests.labels(outcome).inc()
        self.prompt_tokens.inc(result.prompt_tokens)
        self.cached_tokens.inc(cached_tokens)
        self.generated_tokens.inc(result.generated_tokens)
        self.kv_held.inc(result.kv_bytes)
        self.kv_full.inc(result.full_kv_bytes)
        if result.generated_tokens:
            self.ttft.observe(result.ttft_ms / 1e3)
        if result.generated_tokens > 1:
            self.tpot.observe(result.tpot_ms / 1e3)

    def refused(self, outcome: str) -> None:
        self.requests.labels(outcome).inc()

    def error_response(self, status: int) -> None:
        """An error response sent (any: a bad body, a missing key, an unknown path, a full queue)."""
        self.errors.labels(str(status)).inc()

    def exposition(self) -> bytes:
        for key, value in self.stats().items():
            if key.startswith(DISK_EVENT):
                self.disk_events.labels(key.removeprefix(DISK_EVENT)).set(value)
            else:
                self.gauges[key].set(value)
        return generate_latest(self.registry)
