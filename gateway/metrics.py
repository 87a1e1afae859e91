"""Prometheus metrics, one registry per app (no process-global collectors)."""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("kvrelay_ttft_seconds", "Time to the first generated content chunk",
                              ["model"], buckets=_LATENCY_BUCKETS, registry=r)
        self.latency = Histogram("kvrelay_request_duration_seconds", "End-to-end request latency at the gateway",
                                 ["model", "status"], buckets=_LATENCY_BUCKETS, registry=r)
        self.upstream_latency = Histogram("kvrelay_upstream_duration_seconds", "Upstream call duration",
                                          ["upstream"], buckets=_LATENCY_BUCKETS, registry=r)
        self.overhead = Histogram("kvrelay_gateway_overhead_seconds",
                                  "Time the gateway spends before dispatching upstream",
                                  buckets=_OVERHEAD_BUCKETS, registry=r)
        self.requests = Counter("kvrelay_requests_total", "Requests by outcome", ["status"], registry=r)
        self.tokens = Counter("kvrelay_tokens_total", "Tokens by kind", ["kind"], registry=r)
        self.in_flight = Gauge("kvrelay_in_flight_requests", "Requests being proxied now", registry=r)

    def count_bounds(self, bounded: Tally[str]) -> None:
        """Export what the inference state's bounds cut (evicted sessions and apps, texts
        not kept, plans cut), read at each scrape."""
        self.registry.register(_BoundsCollector(bounded))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _BoundsCollector(Collector):
    def __init__(self, bounded: Tally[str]) -> None:
        self.bounded = bounded

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily("kvrelay_state_bounded", "Inference state cut by a bound, by kind", labels=["kind"])
        for kind in ("sessions_evicted", "apps_evicted", "texts_not_kept", "plans_cut"):
            family.add_metric([kind], float(self.bounded[kind]))
        yield family
