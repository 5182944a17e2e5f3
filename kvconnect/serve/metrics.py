"""Prometheus metrics of `kvconnect serve`, under vLLM's names where vLLM has the same thing.

    vllm:prompt_tokens_total, vllm:generation_tokens_total         counters
    vllm:prefix_cache_queries_total, vllm:prefix_cache_hits_total  prompt tokens looked up in
                                                                   the engine's prefix cache,
                                                                   and found there
    vllm:request_success_total{finished_reason}                    finished requests
    vllm:time_to_first_token_seconds, vllm:e2e_request_latency_seconds   histograms
    vllm:num_requests_running, vllm:num_requests_waiting, vllm:kv_cache_usage_perc   gauges
    kvconnect_connector_loaded_tokens_total                        prompt tokens a KV
                                                                   connector loaded
    vllm:prompt_tokens_cached_by_source_total{source}              cached prompt tokens by
                                                                   where they came from:
                                                                   device, host, p2p, disk,
                                                                   external_unspecified
    kvconnect_kv_events_total, kvconnect_kv_event_batches_*        the event stream
    kvconnect_connector_<stat>                                     the connector's own stats
    kvconnect:offload_<stat>                                       the same, under the name
                                                                   kvconnect's vLLM plugin
                                                                   gives them in vLLM's
                                                                   /metrics (one dashboard
                                                                   for both engines)

Every metric has vLLM's `model_name` label. Counters are updated by the engine thread as
requests finish; the engine's gauges and totals come from one `EngineStats` snapshot
(`LLM.stats`) taken when scraped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvconnect.connector.base import CacheHitSource
from kvconnect.engine.llm import EngineStats
from kvconnect.engine.request import Request

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)


class ServeMetrics:
    def __init__(self, model_name: str, engine_stats: Callable[[], EngineStats]) -> None:
        """`engine_stats` is asked at every scrape, on a thread of its own."""
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, [*labels, *extra], registry=self.registry)

        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated.")
        self.cache_queries = counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.cache_hits = counter(
            "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache."
        )
        self.loaded_tokens = counter(
            "kvconnect_connector_loaded_tokens", "Prompt tokens a KV connector loaded."
        )
        self.cached_by_source = counter(
            "vllm:prompt_tokens_cached_by_source",
            "Prefix-cache hit tokens by the cache tier that supplied them: device (the "
            "engine's own), host, disk, p2p (pulled from another instance) or "
            "external_unspecified (a shared store).",
            extra=("source",),
        )
        for source in CacheHitSource:  # every label from the start, as vLLM's
            self.cached_by_source.labels(model_name, source.value)
        self.success = counter(
            "vllm:request_success", "Finished requests.", extra=("finished_reason",)
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to the first generated token.",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Time from arrival to the last token.",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_EngineGauges(engine_stats, model_name))

    def finished(self, request: Request, ttft: float | None, e2e: float) -> None:
        """A request finished (called on the engine thread)."""
        m = self.model_name
        self.prompt_tokens.labels(m).inc(len(request.prompt_token_ids))
        self.generation_tokens.labels(m).inc(len(request.output_token_ids))
        self.cache_queries.labels(m).inc(len(request.prompt_token_ids))
        self.cache_hits.labels(m).inc(request.num_cached_tokens or 0)
        self.loaded_tokens.labels(m).inc(request.num_external_tokens)
        for source, n in cached_by_source(request).items():
            self.cached_by_source.labels(m, source).inc(n)
        self.success.labels(m, request.status.finish_reason or "unknown").inc()
        if ttft is not None:
            self.ttft.labels(m).observe(ttft)
        self.e2e.labels(m).observe(e2e)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def cached_by_source(request: Request) -> dict[str, int]:
    """A request's cached prompt tokens by source: the engine's own hits (device), then what
    its connector loaded, by the tier it came from; non-zero ones only."""
    found = {CacheHitSource.DEVICE.value: request.num_cached_tokens or 0}
    for source, n in request.external_hit_sources.items():
        found[source] = found.get(source, 0) + n
    unsaid = request.num_external_tokens - sum(request.external_hit_sources.values())
    if unsaid > 0:  # a connector that does not say where it loaded from
        unspecified = CacheHitSource.EXTERNAL_UNSPECIFIED.value
        found[unspecified] = found.get(unspecified, 0) + unsaid
    return {k: v for k, v in found.items() if v}


class _EngineGauges(Collector):
    """What the engine holds now, and its totals, read at scrape time."""

    def __init__(self, engine_stats: Callable[[], EngineStats], model_name: str) -> None:
        self.engine_stats = engine_stats
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        stats, labels = self.engine_stats(), [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(labels, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(labels, value)
            return c

        yield gauge("vllm:num_requests_running", "Requests running.", stats.num_running)
        yield gauge("vllm:num_requests_waiting", "Requests waiting.", stats.num_waiting)
        yield gauge(
            "vllm:kv_cache_usage_perc", "KV cache blocks in use (0-1).", stats.kv_cache_usage
        )
        yield counter(
            "kvconnect_preemptions", "Requests preempted for blocks.", stats.num_preemptions
        )
        yield counter(
            "kvconnect_kv_events", "KV cache events published.", stats.num_events_published
        )
        yield counter(
            "kvconnect_kv_event_batches_published",
            "KV event batches published.",
            stats.num_event_batches_published,
        )
        yield counter(
            "kvconnect_kv_event_batches_dropped",
            "KV event batches not sent live (queue full; replayable).",
            stats.num_event_batches_dropped,
        )
        yield gauge(
            "kvconnect_kv_event_subscriptions",
            "Subscriptions of the live KV event stream.",
            stats.num_event_subscriptions,
        )
        for key, value in stats.connector.items():
            yield counter(f"kvconnect_connector_{key}", f"Connector stat {key}.", value)
            yield counter(  # kvconnect/vllm/adapter.py's OffloadPromMetrics names them so
                f"kvconnect:offload_{key}",
                f"kvconnect OffloadConnector: {key.replace('_', ' ')}.",
                value,
            )
