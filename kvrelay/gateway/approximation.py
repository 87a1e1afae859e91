"""Approximate KV reuse, by opt-in only: which requests may run an approximate method.

By default every request is exact: its plan names no method, so the engine reuses KV
only through exact prefix hits, and the answer is the answer without a plan.
Approximate methods (shift, blend, link, kvcomm) place cached KV computed behind another
prefix; they save prefill but change answers, so they run only where the operator or
the client asked:

- `approximation.rules` in the gateway's settings (or the YAML `approximation.file`,
  `{rules: [...]}`): the first rule whose conditions all hold (fnmatch globs on tenant,
  app, agent and model) names the method for the request's reusable segments;
- the `X-Kvrelay-Reuse` header of one request: a method name opts that request in,
  `exact` keeps it exact whatever the rules say, `off` sends no segments at all.

An opted-in method still runs only while the fidelity guard (kvrelay/gateway/fidelity_guard.py)
lets it: a method whose measured fidelity fell below the floor for an app is off there.
"""

from __future__ import annotations

from collections.abc import Sequence
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Annotated, Literal, Protocol, TypeGuard, get_args

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from kvrelay.wire.plan import SegmentPlan
from kvrelay.gateway.rule_files import load_rule_file

ApproxMethod = Literal["shift", "blend", "link", "kvcomm"]
APPROX_METHODS: tuple[ApproxMethod, ...] = get_args(ApproxMethod)
# What a client may send in X-Kvrelay-Reuse; `on` (the rules decide) when absent.
HeaderChoice = Literal["on", "off", "exact"] | ApproxMethod
_ON_WORDS = frozenset({"on", "1", "true"})
_OFF_WORDS = frozenset({"off", "0", "false"})
Glob = Annotated[str, Field(min_length=1, max_length=256)]


class ApproxRule(BaseModel):
    """Requests matching every condition given run `method` on their segments.
    A rule with no condition opts in every request of the gateway."""

    model_config = ConfigDict(extra="forbid")  # a misspelt condition must not match everything

    method: ApproxMethod
    tenant: Glob | None = None
    app: Glob | None = None
    agent: Glob | None = None
    model: Glob | None = None

    def matches(self, tenant: str, app: str, agent: str | None, model: str) -> bool:
        wanted = ((self.tenant, tenant), (self.app, app), (self.agent, agent or ""), (self.model, model))
        return all(glob is None or fnmatchcase(value, glob) for glob, value in wanted)


class _RuleFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rules: list[ApproxRule] = []


class GuardSettings(BaseModel):
    """The online fidelity guard (kvrelay/gateway/fidelity_guard.py): a `sample_rate` share of
    approximate requests is scored again densely on the engine's spare capacity; a
    method whose rolling figures for an app fall below the floor (top-1 agreement under
    `min_top1`, or mean KL over `max_kl`) over at least `min_samples` scores is switched
    off for that app, until an operator re-enables it or, after `cooldown_s`, a re-probe
    passes."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    sample_rate: Annotated[float, Field(ge=0.0, le=1.0)] = 0.05
    min_top1: Annotated[float, Field(ge=0.0, le=1.0)] = 0.95
    max_kl: Annotated[float, Field(ge=0.0)] = 0.02
    window: Annotated[int, Field(ge=1, le=10_000)] = 50  # scores in the rolling figures
    min_samples: Annotated[int, Field(ge=1, le=10_000)] = 5  # scores before a decision
    cooldown_s: Annotated[float, Field(gt=0)] = 600.0
    poll_interval_s: Annotated[float, Field(gt=0, le=3600)] = 2.0  # how often engines are asked for scores


class ApproximationSettings(BaseModel):
    """Opt-in approximate reuse: `rules` here, then those of the YAML `file`, first match
    wins; and the online fidelity guard that watches every opted-in method. The file is
    read when the settings are built, so a missing or invalid one stops the gateway at
    startup."""

    model_config = ConfigDict(extra="forbid")

    rules: list[ApproxRule] = []
    file: Path | None = None
    allow_header: bool = True  # a client may opt its own requests in with X-Kvrelay-Reuse: METHOD
    guard: GuardSettings = GuardSettings()
    _file_rules: list[ApproxRule] = PrivateAttr(default_factory=list)

    @model_validator(mode="after")
    def _load_file(self) -> ApproximationSettings:
        if self.file is not None:
            self._file_rules = load_rules(self.file)
        return self

    @property
    def all_rules(self) -> list[ApproxRule]:
        return [*self.rules, *self._file_rules]



def load_rules(path: Path) -> list[ApproxRule]:
    """The rules of an approximation file; ValueError naming the file and the problem."""
    return load_rule_file(path, _RuleFile, "approximation").rules


def _names_a_choice(word: str) -> TypeGuard[HeaderChoice]:
    return word == "exact" or word in APPROX_METHODS


def parse_header(value: str | None) -> HeaderChoice:
    """X-Kvrelay-Reuse as a choice; ValueError with the accepted values for anything else."""
    if value is None:
        return "on"
    word = value.strip().lower()
    if word in _ON_WORDS:
        return "on"
    if word in _OFF_WORDS:
        return "off"
    if _names_a_choice(word):
        return word
    raise ValueError(f"must be on, off, exact or an approximate method ({', '.join(APPROX_METHODS)})")


class MethodSwitch(Protocol):
    """Whether a method may run for an app now (the fidelity guard implements it)."""

    def allows(self, tenant: str, app: str, method: ApproxMethod) -> bool: ...


class ProbeSampler(Protocol):
    """Whether an approximate request is scored again densely (the fidelity guard)."""

    def should_probe(self, tenant: str, app: str, method: ApproxMethod) -> bool: ...


class Approximation:
    """Decides a request's approximate method, if any, and writes it into the plan."""

    def __init__(self, rules: Sequence[ApproxRule] = (), allow_header: bool = True,
                 switch: MethodSwitch | None = None, sampler: ProbeSampler | None = None) -> None:
        self._rules = tuple(rules)
        self.allow_header = allow_header
        self.switch = switch
        self.sampler = sampler

    @classmethod
    def from_settings(cls, settings: ApproximationSettings, switch: MethodSwitch | None = None,
                      sampler: ProbeSampler | None = None) -> Approximation:
        return cls(settings.all_rules, settings.allow_header, switch, sampler)

    def wants_probe(self, tenant: str, app: str, method: ApproxMethod | None) -> bool:
        """Whether the engine should score this request again densely (never an exact one)."""
        return method is not None and self.sampler is not None and self.sampler.should_probe(tenant, app, method)

    def method_for(self, choice: HeaderChoice, tenant: str, app: str, agent: str | None,
                   model: str) -> ApproxMethod | None:
        """The approximate method this request runs, or None (exact)."""
        if choice == "off" or choice == "exact":
            return None
        if choice != "on":
            if not self.allow_header:
                return None
            method: ApproxMethod | None = choice
        else:
            method = next((r.method for r in self._rules if r.matches(tenant, app, agent, model)), None)
        if method is not None and self.switch is not None and not self.switch.allows(tenant, app, method):
            return None
        return method

    @staticmethod
    def apply(plan: SegmentPlan, method: ApproxMethod | None, probe: bool = False) -> SegmentPlan:
        """The plan with `method` on every segment, asking for a fidelity probe when
        `probe`; unchanged when exact. The engine places only reusable segments; on a
        private one the method says the request opted in, so the engine keeps its
        segments and answer for later approximate reuse even when it has nothing to
        place itself (an agent's first turn, whose answer the next agent reads)."""
        if method is None:
            return plan
        segments = [s.model_copy(update={"method": method}) for s in plan.segments]
        return plan.model_copy(update={"segments": segments, "probe": probe})
