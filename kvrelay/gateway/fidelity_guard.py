"""The online fidelity guard: switches an approximate method off for an app whose
measured fidelity fell below the floor.

Engines score a sample of approximate requests again densely (engine_ext/probes.py);
`FidelityPoller` (kvrelay/gateway/fidelity_poll.py) brings their scores here. Per (tenant, app,
method) the guard keeps the last `window` scores. Once at least `min_samples` are in, a
mean top-1 agreement under `min_top1` or a mean KL over `max_kl` switches the method off
for that app (logged, counted): `Approximation` then runs its requests exact. After
`cooldown_s` the method goes on probation: it runs again with every request probed,
and the first `min_samples` new scores decide, on again or off again. An operator can
switch it on at any time (`enable`, behind the admin API).
"""

from __future__ import annotations

import logging
import random
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from kvrelay.gateway.approximation import GuardSettings

logger = logging.getLogger(__name__)

GuardState = Literal["on", "off", "probation"]
MAX_KEYS = 10_000  # (tenant, app, method) tracked; the least recently scored `on` ones go first


class Score(NamedTuple):
    """One probe result, as an engine reports it."""

    tenant: str
    app: str
    method: str
    top1: float
    kl: float
    tokens: int = 0


class Key(NamedTuple):
    tenant: str
    app: str
    method: str


@dataclass
class Figures:
    """One (tenant, app, method): its rolling scores and its state."""

    window: deque[tuple[float, float]]
    state: GuardState = "on"
    since: float = 0.0  # monotonic time of the last change of state
    num_scores: int = 0
    num_switch_offs: int = 0
    at_switch_off: tuple[float, float] | None = None  # the figures that switched it off last
    updated: float = field(default_factory=time.monotonic)

    def means(self) -> tuple[float, float] | None:
        if not self.window:
            return None
        return (sum(t for t, _ in self.window) / len(self.window), sum(k for _, k in self.window) / len(self.window))


class FidelityGuard:
    """`MethodSwitch` and `ProbeSampler` for `Approximation`; fed by `record`."""

    def __init__(self, settings: GuardSettings, rng: random.Random | None = None,
                 clock: Callable[[], float] = time.monotonic, max_keys: int = MAX_KEYS) -> None:
        self.settings = settings
        self._rng = rng if rng is not None else random.Random()
        self._clock = clock
        self._max_keys = max_keys
        self._figures: OrderedDict[Key, Figures] = OrderedDict()
        self.num_switch_offs: dict[str, int] = {}  # per method, for the counter in /metrics
        self.num_scores = 0

    # -- what Approximation asks ----------------------------------------------------------
    def allows(self, tenant: str, app: str, method: str) -> bool:
        """Off: not until the cool-down has passed, which puts the method on probation."""
        figures = self._figures.get(Key(tenant, app, method))
        if figures is None or figures.state != "off":
            return True
        if self._clock() - figures.since < self.settings.cooldown_s:
            return False
        self._change(figures, "probation")
        logger.info("fidelity guard: %s for app %s (tenant %s) on probation after its cool-down; "
                    "every request is probed until %d scores decide", method, app, tenant, self.settings.min_samples)
        return True

    def should_probe(self, tenant: str, app: str, method: str) -> bool:
        """Whether an approximate request of this (tenant, app, method) is scored again:
        every one on probation, else a `sample_rate` share."""
        figures = self._figures.get(Key(tenant, app, method))
        if figures is not None and figures.state == "probation":
            return True
        return self._rng.random() < self.settings.sample_rate

    # -- what engines report --------------------------------------------------------------
    def record(self, score: Score) -> None:
        """Add a score and decide once `min_samples` are in. Scores of a method that is
        off are kept for the figures but decide nothing (it is off already)."""
        key = Key(score.tenant, score.app, score.method)
        figures = self._figures.get(key)
        if figures is None:
            figures = self._figures[key] = Figures(deque(maxlen=self.settings.window), since=self._clock())
            self._evict()
        self._figures.move_to_end(key)
        figures.window.append((score.top1, score.kl))
        figures.num_scores += 1
        figures.updated = self._clock()
        self.num_scores += 1
        if figures.state == "off" or len(figures.window) < self.settings.min_samples:
            return
        means = figures.means()
        if means is None:  # an empty window: not past the check above (min_samples >= 1)
            return
        top1, kl = means
        passes = top1 >= self.settings.min_top1 and kl <= self.settings.max_kl
        if passes:
            if figures.state == "probation":
                self._change(figures, "on")
                logger.info("fidelity guard: %s for app %s (tenant %s) passed its re-probe (top-1 %.3f, KL %.4f); on",
                            key.method, key.app, key.tenant, top1, kl)
            return
        was = figures.state
        figures.at_switch_off = (top1, kl)
        figures.num_switch_offs += 1
        self.num_switch_offs[key.method] = self.num_switch_offs.get(key.method, 0) + 1
        self._change(figures, "off")
        logger.warning("fidelity guard: %s switched off for app %s (tenant %s)%s: top-1 %.3f (floor %.3f), "
                       "KL %.4f (ceiling %.4f) over %d scores; exact for %gs, then re-probed",
                       key.method, key.app, key.tenant, " after its re-probe" if was == "probation" else "",
                       top1, self.settings.min_top1, kl, self.settings.max_kl, len(figures.window),
                       self.settings.cooldown_s)

    # -- what operators do ----------------------------------------------------------------
    def enable(self, tenant: str | None, app: str, method: str) -> list[str]:
        """Switch a method back on for an app now, for one tenant or (None) every tenant
        it is off or on probation for; the tenants switched on."""
        keys = [k for k, f in self._figures.items() if f.state != "on" and k.app == app and k.method == method
                and tenant in (None, k.tenant)]
        for key in keys:
            self._change(self._figures[key], "on")
            logger.warning("fidelity guard: %s re-enabled for app %s (tenant %s) by an operator", method, app,
                           key.tenant)
        return [k.tenant for k in keys]

    def snapshot(self) -> list[dict[str, Any]]:
        """Every (tenant, app, method) tracked, most recently scored first."""
        now = self._clock()
        rows = []
        for key, f in reversed(self._figures.items()):
            means = f.means()
            rows.append({"tenant": key.tenant, "app": key.app, "method": key.method, "state": f.state,
                         "top1": means[0] if means else None, "kl": means[1] if means else None,
                         "samples": len(f.window), "scores": f.num_scores, "switch_offs": f.num_switch_offs,
                         "state_for_s": round(now - f.since, 3),
                         "reprobe_in_s": (round(max(0.0, f.since + self.settings.cooldown_s - now), 3)
                                          if f.state == "off" else None),
                         "at_switch_off": ({"top1": f.at_switch_off[0], "kl": f.at_switch_off[1]}
                                           if f.at_switch_off else None)})
        return rows

    def _change(self, figures: Figures, state: GuardState) -> None:
        """A new state starts from new scores: a re-enabled or re-probed method is judged
        on how it does now, not on the scores that switched it off."""
        figures.state, figures.since = state, self._clock()
        if state != "off":
            figures.window.clear()

    def _evict(self) -> None:
        while len(self._figures) > self._max_keys:
            victim = next((k for k, f in self._figures.items() if f.state == "on"), next(iter(self._figures)))
            del self._figures[victim]
