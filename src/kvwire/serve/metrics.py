"""What ``GET /metrics`` exposes (Prometheus text format, via prometheus-client).

vLLM's names, so existing dashboards work (``kvwire:`` instead of ``vllm:``):

    kvwire:prefix_cache_queries_total   prompt tokens looked up in the prefix cache
    kvwire:prefix_cache_hits_total      of those, tokens served from it
    kvwire:num_requests_running         sequences in the batch
    kvwire:num_requests_waiting         requests waiting for a batch slot
    kvwire:prompt_tokens_total, kvwire:generation_tokens_total
    kvwire:request_success_total{finished_reason}
    kvwire:time_to_first_token_seconds, kvwire:e2e_request_latency_seconds   (histograms)

and kvwire's own:

    kvwire_requests_total{status}              every request answered, by HTTP status (200, 400, 429, ...)
    kvwire_stream_errors_total{status}         streams answered 200 that then ended in an error event, by the
                                               status the error would have had (alert on these with the 5xx)
    kvwire_cached_tokens_total                 prompt tokens served from cache (prefix + spliced)
    kvwire_spliced_tokens_total, kvwire_recomputed_tokens_total
    kvwire_prefill_seconds_saved_total         cached tokens x this server's measured prefill seconds per token
    kvwire_rebuilds_total{reason}              caches refused and recomputed: corrupt, foreign, broken-chain,
                                               mismatch, store-unreachable
    kvwire_store_bytes                         bytes the store holds (read at each scrape)
    kvwire_store_evictions                     keys this server's store evicted to stay in its budget (at each scrape)
    kvwire_store_published_bytes_total         K/V bytes published
    kvwire_store_degraded                      1 while the store is unreachable (requests served without reuse)
    kvwire_cancelled_total                     requests whose client went away before the end
    kvwire_batch_rows                          sequences in each decode step (histogram): continuous batching at work

Each server has its own registry, so several can run in one process (tests do).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.queries = Counter("kvwire:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                               registry=r)
        self.hits = Counter("kvwire:prefix_cache_hits", "Prompt tokens served from the prefix cache", registry=r)
        self.running = Gauge("kvwire:num_requests_running", "Sequences in the batch", registry=r)
        self.waiting = Gauge("kvwire:num_requests_waiting", "Requests waiting for a batch slot", registry=r)
        self.prompt_tokens = Counter("kvwire:prompt_tokens", "Prompt tokens of requests", registry=r)
        self.generation_tokens = Counter("kvwire:generation_tokens", "Tokens generated", registry=r)
        self.success = Counter("kvwire:request_success", "Requests finished", ["finished_reason"], registry=r)
        self.ttft = Histogram("kvwire:time_to_first_token_seconds", "Arrival to first token", registry=r,
                              buckets=LATENCY_BUCKETS)
        self.e2e = Histogram("kvwire:e2e_request_latency_seconds", "Arrival to last token", registry=r,
                             buckets=LATENCY_BUCKETS)
        self.requests = Counter("kvwire_requests", "Requests answered, by HTTP status", ["status"], registry=r)
        self.stream_errors = Counter("kvwire_stream_errors", "Streams (answered 200) that ended in an error event, "
                                     "by the status the error would have had", ["status"], registry=r)
        self.cached = Counter("kvwire_cached_tokens", "Prompt tokens served from cache (prefix + spliced)",
                              registry=r)
        self.spliced = Counter("kvwire_spliced_tokens", "Tokens of earlier completions and messages spliced in",
                               registry=r)
        self.recomputed = Counter("kvwire_recomputed_tokens", "Spliced and gap tokens recomputed", registry=r)
        self.saved = Counter("kvwire_prefill_seconds_saved", "Cached tokens x measured prefill seconds per token",
                             registry=r)
        self.rebuilds = Counter("kvwire_rebuilds", "Caches refused and recomputed, by reason", ["reason"],
                                registry=r)
        self.store_used = Gauge("kvwire_store_bytes", "Bytes the store holds", registry=r)
        self.store_evictions = Gauge("kvwire_store_evictions", "Keys the store evicted to stay in its budget",
                                     registry=r)
        self.published_bytes = Counter("kvwire_store_published_bytes", "K/V bytes published", registry=r)
        self.degraded = Gauge("kvwire_store_degraded", "1 while the store is unreachable", registry=r)
        self.cancelled = Counter("kvwire_cancelled", "Requests whose client went away before the end", registry=r)
        self.batch = Histogram("kvwire_batch_rows", "Sequences in each decode step", registry=r,
                               buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64))

    def prefix_query(self, tokens: int, hit: int) -> None:
        self.queries.inc(tokens)
        self.hits.inc(hit)

    def rebuild(self, reason: str) -> None:
        self.rebuilds.labels(reason=reason).inc()

    def published(self, nbytes: int) -> None:
        self.published_bytes.inc(nbytes)

    def store_bytes(self, nbytes: int, evictions: int | None = None) -> None:
        self.store_used.set(nbytes)
        if evictions is not None:
            self.store_evictions.set(evictions)

    def store_state(self, state: str) -> None:
        self.degraded.set(1 if state == "degraded" else 0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
