"""Which LoRA adapter a request runs on: the client's choice, else the operator's rules.

An engine serving adapters on one base model takes `"model": "BASE:ADAPTER"`. Agent
frameworks mostly send one model name for every agent, so the gateway can pick an
adapter per agent instead: `AdapterSettings.rules` map agent ids (fnmatch globs) and
system prompts (regexes) to adapter names. A client that names an adapter itself is
never overridden.

The result is an `AdapterRef` (base and adapter apart) in the SegmentPlan: with ICaRus
every adapter of one base reads the same KV cache, so what matters for placement is the
base and the session, never the adapter (session affinity in gateway.upstreams keeps all
of a session's requests on one upstream whatever adapter each names).

Routing is pure: the adapters file is read once, when the settings are built.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase

from kvrelay.wire.plan import AdapterRef
from kvrelay.gateway.settings import AdapterRule, AdapterSettings


@dataclass(frozen=True)
class _Rule:
    """An AdapterRule with its regex compiled once."""

    adapter: str
    agent: str | None
    system: re.Pattern[str] | None
    base: str | None

    @classmethod
    def of(cls, rule: AdapterRule) -> _Rule:
        return cls(rule.adapter, rule.agent, re.compile(rule.system) if rule.system is not None else None, rule.base)

    def matches(self, model: str, agent_id: str, system_text: str | None) -> bool:
        if self.base is not None and self.base != model:
            return False
        if self.agent is not None and not fnmatchcase(agent_id, self.agent):
            return False
        if self.system is not None and (system_text is None or self.system.search(system_text) is None):
            return False
        return True


class AdapterRouter:
    """Maps (client model, agent, system prompt) to the AdapterRef the request runs on."""

    def __init__(self, rules: Sequence[AdapterRule] = ()) -> None:
        self._rules = tuple(_Rule.of(rule) for rule in rules)

    @classmethod
    def from_settings(cls, settings: AdapterSettings) -> AdapterRouter:
        """The settings' own rules first, then the file's (loaded when they were validated)."""
        return cls(settings.all_rules)

    @property
    def num_rules(self) -> int:
        return len(self._rules)

    def route(self, model: str, agent_id: str, system_text: str | None) -> AdapterRef:
        """`base:name` from the client wins; else the first matching rule's adapter on
        the client's model; else the model itself. A name with an empty part (`m:`,
        `:a`) passes through untouched, as a base of its own: the engine judges it."""
        if ":" in model:
            return AdapterRef.of(model)
        for rule in self._rules:
            if rule.matches(model, agent_id, system_text):
                return AdapterRef(base=model, name=rule.adapter)
        return AdapterRef(base=model)  # the client's model (validating it is faster than model_construct)
