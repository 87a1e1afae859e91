"""PlanReader: the plan a request carries, if the engine may follow it.

A plan is advice: a malformed one, or (with a PlanSeal) one the gateway did not seal,
is ignored with a warning and counted by reason, and the request runs densely under
the default tenant; never an error for the user. Without a seal (an engine that
listens on loopback alone, next to its gateway) every well-formed plan is followed.

A plan indexes the messages of the gateway's view of a request. A Responses request
that continues an earlier response (previous_response_id) has history the gateway
never saw, inserted by the engine: `MessageShift` moves the plan's later messages past
it, applied after the seal check, so a sealed plan is verified as the gateway sealed it.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any

from kvrelay.wire.seal import SEAL_KEY, PlanSeal
from kvrelay.wire.plan import PLAN_KEY, SegmentPlan

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MessageShift:
    """Messages inserted into a request after the gateway planned it: `count` of them,
    before the message the gateway's view had at index `at`. (Not a NamedTuple: its
    `count` would hide tuple.count.)"""

    at: int
    count: int

    def apply(self, plan: SegmentPlan) -> SegmentPlan:
        if not self.count or not any(s.message_index >= self.at for s in plan.segments):
            return plan
        segments = [s.model_copy(update={"message_index": s.message_index + self.count})
                    if s.message_index >= self.at else s for s in plan.segments]
        return plan.model_copy(update={"segments": segments})


class PlanReader:
    def __init__(self, seal: PlanSeal | None = None) -> None:
        self.seal = seal
        self.ignored: Counter[str] = Counter()  # reason -> plans ignored (engine /metrics)

    def read(self, params: Any, shift: MessageShift | None = None) -> SegmentPlan | None:
        """The plan to follow, its segments moved past the messages `shift` inserted."""
        if not isinstance(params, dict) or PLAN_KEY not in params:
            return None
        if self.seal is not None:
            check = self.seal.check(params[PLAN_KEY], params.get(SEAL_KEY))
            if not check.accepted:
                self._ignore(check.reason or "forged", "its seal does not check out")
                return None
        try:
            plan = SegmentPlan.model_validate(params[PLAN_KEY])
        except ValueError as exc:
            self._ignore("malformed", str(exc).splitlines()[0])
            return None
        return plan if shift is None else shift.apply(plan)

    def _ignore(self, reason: str, why: str) -> None:
        self.ignored[reason] += 1
        logger.warning("ignoring a segment plan (%s): %s; the request runs densely", reason, why)

    def metrics(self) -> str:
        """Prometheus text: plans ignored, by reason."""
        lines = ["# HELP kvrelay_engine_plans_ignored_total Segment plans the engine ignored, by reason",
                 "# TYPE kvrelay_engine_plans_ignored_total counter"]
        for reason in ("unsealed", "malformed", "forged", "stale"):
            lines.append(f'kvrelay_engine_plans_ignored_total{{reason="{reason}"}} {self.ignored[reason]}')
        return "\n".join(lines) + "\n"
