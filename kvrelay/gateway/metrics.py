"""Prometheus metrics, one registry per app (no process-global collectors).

Label values come from bounded sets only, so no request can add a series or put text
in /metrics that breaks a scrape: a model label is a model some upstream serves, or
"other"; statuses, kinds and upstream URLs are the gateway's own.
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, TypeVar, cast

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from kvrelay.gateway.inference.replication import SharedLog
    from kvrelay.gateway.storage.writer import RecordWriter

OTHER_MODEL = "other"
_M = TypeVar("_M", bound=MetricWrapperBase)
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1)


class GatewayMetrics:
    def __init__(self, is_served: Callable[[str], bool] = lambda _: False) -> None:
        """`is_served(model)`: whether an upstream serves that model now (its name may be a label)."""
        self.is_served = is_served
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
        self._children: dict[tuple[int, tuple[str, ...]], MetricWrapperBase] = {}  # see child()

    def child(self, metric: _M, *values: str) -> _M:
        """`metric.labels(*values)`, kept after the first call: labels() checks, converts
        and locks on every call, several times per request on the proxy path. The cache
        is as bounded as the label values are (see above)."""
        key = (id(metric), values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values)
        return cast(_M, child)  # the child of a metric is of the metric's class

    def model_label(self, model: str | None) -> str:
        """`model` when an upstream serves it, else "other": a client's string never
        becomes a label by itself."""
        return model if model and self.is_served(model) else OTHER_MODEL

    def count_records(self, writer: RecordWriter) -> None:
        """Export the record writer's counters and whether it runs, read at each scrape."""
        self.registry.register(_WriterCollector(writer))

    def count_bounds(self, bounded: Tally[str]) -> None:
        """Export what the inference state's bounds cut (evicted sessions, apps and agents,
        texts and step-graph edges not kept, plans cut or over their time budget), read at
        each scrape."""
        self.registry.register(_BoundsCollector(bounded))

    def count_replication(self, log: SharedLog) -> None:
        """Export what this replica shared and applied, and how stale the others' observations were."""
        self.registry.register(_ReplicationCollector(log))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _BoundsCollector(Collector):
    def __init__(self, bounded: Tally[str]) -> None:
        self.bounded = bounded

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily("kvrelay_state_bounded", "Inference state cut by a bound, by kind", labels=["kind"])
        for kind in ("sessions_evicted", "apps_evicted", "texts_not_kept", "plans_cut", "agents_evicted",
                     "agent_matches_cut", "step_edges_not_kept", "plans_over_budget", "holders_dropped"):
            family.add_metric([kind], float(self.bounded[kind]))
        yield family


class _WriterCollector(Collector):
    def __init__(self, writer: RecordWriter) -> None:
        self.writer = writer

    def collect(self) -> Iterator[Metric]:
        w = self.writer
        family = CounterMetricFamily("kvrelay_records", "Request records by fate", labels=["fate"])
        for fate, value in (("written", w.num_written), ("dropped", w.num_dropped),
                            ("quarantined", w.num_quarantined)):
            family.add_metric([fate], float(value))
        yield family
        yield CounterMetricFamily("kvrelay_record_write_errors", "Failed attempts to write a batch of records",
                                  value=float(w.num_write_errors))
        yield CounterMetricFamily("kvrelay_record_writer_restarts", "Times the record writer was restarted",
                                  value=float(w.num_restarts))
        yield GaugeMetricFamily("kvrelay_record_writer_up", "1 while the record writer runs", value=float(w.alive))
        yield GaugeMetricFamily("kvrelay_record_backlog", "Records waiting to be written", value=float(w.backlog))


class _ReplicationCollector(Collector):
    def __init__(self, log: SharedLog) -> None:
        self.log = log

    def collect(self) -> Iterator[Metric]:
        log = self.log
        family = CounterMetricFamily("kvrelay_replication_observations", "Observations shared with other replicas",
                                     labels=["fate"])
        for fate, value in (("published", log.num_published), ("appended", log.num_appended),
                            ("applied", log.num_applied), ("dropped", log.num_dropped),
                            ("not_applied", log.num_apply_errors)):
            family.add_metric([fate], float(value))
        yield family
        errors = CounterMetricFamily("kvrelay_replication_errors", "Failed reads and appends of the shared log",
                                     labels=["kind"])
        errors.add_metric(["append"], float(log.num_append_errors))
        errors.add_metric(["read"], float(log.num_read_errors))
        yield errors
        misses = CounterMetricFamily("kvrelay_replication_barrier_misses",
                                     "Waits for causal order cut by replication.barrier_ms, by side",
                                     labels=["side"])
        misses.add_metric(["answer"], float(log.num_append_waits_missed))
        misses.add_metric(["plan"], float(log.num_catch_up_misses))
        yield misses
        yield GaugeMetricFamily("kvrelay_replication_backlog", "Observations waiting to be shared",
                                value=float(log.backlog))
        stale = GaugeMetricFamily("kvrelay_replication_staleness_ms",
                                  "Age of the other replicas' observations when applied here, recent window",
                                  labels=["quantile"])
        for q in (0.5, 0.99, 1.0):
            if (age := log.staleness_quantile(q)) is not None:
                stale.add_metric([str(q)], age)
        yield stale
