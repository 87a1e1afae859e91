"""Prometheus metrics, one registry per app (no process-global collectors)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

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

    def render(self) -> bytes:
        return generate_latest(self.registry)
