"""/metrics for the fidelity guard: rolling top-1 and KL and the state per (tenant, app,
method), and the switch-offs per method.

Tenant and app names come from traffic, so the series are bounded: the `MAX_SERIES`
most recently scored (tenant, app, method) get their own; the rest are folded per method
into tenant="other", app="other" (figures weighted by samples, the worst state). A name
that cannot be written out safely is folded the same way.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvrelay.gateway.approximation import APPROX_METHODS
from kvrelay.gateway.fidelity_guard import FidelityGuard
from kvrelay.json_values import encodable

MAX_SERIES = 200
OTHER = "other"
STATE_VALUES = {"on": 0.0, "probation": 1.0, "off": 2.0}
_LABELS = ["tenant", "app", "method"]


class FidelityCollector(Collector):
    def __init__(self, guard: FidelityGuard, max_series: int = MAX_SERIES) -> None:
        self.guard = guard
        self.max_series = max_series

    def collect(self) -> Iterator[Metric]:
        top1 = GaugeMetricFamily("kvrelay_fidelity_top1", "Rolling top-1 agreement of probed approximate requests",
                                 labels=_LABELS)
        kl = GaugeMetricFamily("kvrelay_fidelity_kl", "Rolling mean KL(dense || approximate) of probed requests",
                               labels=_LABELS)
        samples = GaugeMetricFamily("kvrelay_fidelity_samples", "Scores in the rolling window", labels=_LABELS)
        state = GaugeMetricFamily("kvrelay_fidelity_state", "Fidelity guard state: 0 on, 1 probation, 2 off",
                                  labels=_LABELS)
        for labels, row in self._series():
            if row["top1"] is not None:
                top1.add_metric(labels, row["top1"])
                kl.add_metric(labels, row["kl"])
            samples.add_metric(labels, float(row["samples"]))
            state.add_metric(labels, STATE_VALUES[row["state"]])
        yield from (top1, kl, samples, state)
        offs = CounterMetricFamily("kvrelay_fidelity_switch_offs", "Methods switched off for an app by the guard",
                                   labels=["method"])
        for method in APPROX_METHODS:
            offs.add_metric([method], float(self.guard.num_switch_offs.get(method, 0)))
        yield offs
        yield CounterMetricFamily("kvrelay_fidelity_scores", "Probe scores received from engines",
                                  value=float(self.guard.num_scores))

    def _series(self) -> list[tuple[list[str], dict[str, Any]]]:
        own: list[tuple[list[str], dict[str, Any]]] = []
        folded: dict[str, list[dict[str, Any]]] = {}
        for row in self.guard.snapshot():  # most recently scored first
            method = row["method"] if row["method"] in APPROX_METHODS else OTHER
            if len(own) < self.max_series and encodable(row["tenant"]) and encodable(row["app"]):
                own.append(([row["tenant"], row["app"], method], row))
            else:
                folded.setdefault(method, []).append(row)
        for method, rows in folded.items():
            own.append(([OTHER, OTHER, method], _fold(rows)))
        return own


def _fold(rows: list[dict[str, Any]]) -> dict[str, Any]:
    scored = [r for r in rows if r["top1"] is not None and r["samples"]]
    n = sum(r["samples"] for r in scored)
    worst = max(rows, key=lambda r: STATE_VALUES[r["state"]])["state"]
    return {"top1": sum(r["top1"] * r["samples"] for r in scored) / n if n else None,
            "kl": sum(r["kl"] * r["samples"] for r in scored) / n if n else None,
            "samples": n, "state": worst}
