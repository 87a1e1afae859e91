"""PlanReader: the plan a request carries, if the engine may follow it.

A plan is advice: a malformed one, or (with a PlanSeal) one the gateway did not seal,
is ignored with a warning and counted by reason, and the request runs densely under
the default tenant; never an error for the user. Without a seal (an engine that
listens on loopback alone, next to its gateway) every well-formed plan is followed.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

from engine_ext.plan_seal import SEAL_KEY, PlanSeal
from engine_ext.protocol import PLAN_KEY, SegmentPlan

logger = logging.getLogger(__name__)


class PlanReader:
    def __init__(self, seal: PlanSeal | None = None) -> None:
        self.seal = seal
        self.ignored: Counter[str] = Counter()  # reason -> plans ignored (engine /metrics)

    def read(self, params: Any) -> SegmentPlan | None:
        if not isinstance(params, dict) or PLAN_KEY not in params:
            return None
        if self.seal is not None:
            check = self.seal.check(params[PLAN_KEY], params.get(SEAL_KEY))
            if not check.accepted:
                return self._ignore(check.reason or "forged", "its seal does not check out")
        try:
            return SegmentPlan.model_validate(params[PLAN_KEY])
        except ValueError as exc:
            return self._ignore("malformed", str(exc).splitlines()[0])

    def _ignore(self, reason: str, why: str) -> None:
        self.ignored[reason] += 1
        logger.warning("ignoring a segment plan (%s): %s; the request runs densely", reason, why)
        return None

    def metrics(self) -> str:
        """Prometheus text: plans ignored, by reason."""
        lines = ["# HELP kvrelay_engine_plans_ignored_total Segment plans the engine ignored, by reason",
                 "# TYPE kvrelay_engine_plans_ignored_total counter"]
        for reason in ("unsealed", "malformed", "forged", "stale"):
            lines.append(f'kvrelay_engine_plans_ignored_total{{reason="{reason}"}} {self.ignored[reason]}')
        return "\n".join(lines) + "\n"
