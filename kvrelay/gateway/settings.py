"""Gateway settings: environment variables (prefix KVRELAY_) over an optional YAML file.

Nested fields use a double underscore in the environment, e.g.
KVRELAY_TIMEOUTS__FIRST_BYTE_S=30; lists take JSON, e.g.
KVRELAY_UPSTREAMS='["http://127.0.0.1:8000"]'. KVRELAY_CONFIG names the YAML file.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import (BaseModel, ConfigDict, Field, PrivateAttr, SecretStr, field_validator,
                      model_validator)
from pydantic_settings import SettingsConfigDict

from kvrelay.wire.plan import MAX_PLAN_SEGMENTS
from kvrelay.gateway.approximation import ApproximationSettings
from kvrelay.gateway.rule_files import load_rule_file
from kvrelay.gateway.tenancy import TenantMap
from kvrelay.yaml_source import YamlFileSettings

PositiveFloat = Annotated[float, Field(gt=0)]
PositiveInt = Annotated[int, Field(ge=1)]


class Timeouts(BaseModel):
    connect_s: PositiveFloat = 5.0
    first_byte_s: PositiveFloat = 60.0  # until the upstream's response headers arrive
    idle_s: PositiveFloat = 60.0  # between two chunks of a stream
    total_s: PositiveFloat = 600.0


class Breaker(BaseModel):
    failure_threshold: Annotated[int, Field(ge=1)] = 3  # consecutive failures that open it
    cooldown_s: PositiveFloat = 10.0  # open for this long, then one trial request


RoutingPolicyName = Literal["session", "round_robin", "least_loaded", "prefix_hash", "cache_aware"]


class RoutingSettings(BaseModel):
    """Which upstream a request goes to (kvrelay/gateway/routing/policies.py). `cache_aware` weighs
    the prompt tokens a replica would compute (the blocks it reports it holds are not
    computed) against `load_weight` x the work in flight there: the prompt tokens its
    requests have still to compute, and `decode_tokens` for each request. A decode step
    runs every running sequence at once, so one more costs little: on the embedded
    engine (AMD EPYC, 2 cores) a step of 8 sequences took 42 ms against 37 ms for one,
    about half a prompt token's time per extra sequence per step; 8 covers the steps a
    new prompt shares with it. A lower-tier block counts `lower_tier_weight` of a device
    one (it is copied back, not computed). A replica is a contender only where its hit
    covers `min_hit_share` of the prompt; otherwise the request goes where the least
    work is queued (its session's home on a tie). For a request opted into an
    approximate method, the texts it would place count as held where their KV was
    computed, a placed token at `segment_weight` of a cached one: placing costs a few
    percent of computing (KVCOMM's offsets), blend recomputes about 15% of the rows.
    Engines' reports are polled every `cache_poll_interval_s`."""

    model_config = ConfigDict(extra="forbid")

    policy: RoutingPolicyName = "session"
    load_weight: Annotated[float, Field(ge=0, le=1000)] = 1.0
    decode_tokens: Annotated[int, Field(ge=0, le=1_000_000)] = 8
    lower_tier_weight: Annotated[float, Field(ge=0, le=1)] = 0.7
    min_hit_share: Annotated[float, Field(ge=0, le=1)] = 0.5  # a smaller hit is not followed
    segment_weight: Annotated[float, Field(ge=0, le=1)] = 0.9  # a placed token's worth of a cached one
    cache_poll_interval_s: Annotated[float, Field(gt=0, le=3600)] = 1.0
    max_prompts: Annotated[int, Field(ge=1, le=10_000_000)] = 200_000  # prefix keys remembered
    max_blocks: Annotated[int, Field(ge=1, le=100_000_000)] = 200_000  # blocks or keys added between reports


class InferenceSettings(BaseModel):
    """Structure inferred from traffic, and the SegmentPlan sent to the engine."""

    reuse: bool = True  # attach plans (exact unless approximation opts in); a request can opt out with `X-Kvrelay-Reuse: off`
    anchor_chars: Annotated[int, Field(ge=8, le=4096)] = 32  # shortest text found again in prompts
    session_ttl_s: PositiveFloat = 1800.0  # an idle session is forgotten after this
    max_sessions: Annotated[int, Field(ge=1)] = 10_000  # per app, least recently used dropped first
    separators: list[str] = ["<TTSEP>"]  # split messages into blocks (<kv_start>/<kv_end> always do)
    fixed_prefix_delimiters: list[str] = []  # ends an agent's fixed system prefix explicitly
    prefix_min_hits: Annotated[int, Field(ge=1)] = 2  # prompts in a row that confirm a fixed prefix
    same_agent_ratio: Annotated[float, Field(gt=0, le=1)] = 0.9  # share of a system prompt that means same agent
    persist: bool = True  # save the inferred state to SQL (texts included) so a restart continues sessions
    flush_interval_s: Annotated[float, Field(gt=0, le=60)] = 0.5  # how often changed state is saved
    round_hold_ms: Annotated[float, Field(ge=0, le=20)] = 0.0  # hold a round's early requests for the rest (0: off)
    max_apps: Annotated[int, Field(ge=1)] = 10_000  # apps (tenants) held in memory, least recently used out
    max_texts_per_session: Annotated[int, Field(ge=16)] = 4096  # texts a session remembers; later ones are not kept
    max_plan_segments: Annotated[int, Field(ge=1, le=MAX_PLAN_SEGMENTS)] = 1024  # a longer plan is not sent
    # Agents per app held in memory, least recently used out (an evicted one is learned
    # again). Workflows have tens of agents; 1,000 leaves room for per-user variants while
    # the step graph (one node per agent) stays small enough to walk in about a millisecond.
    max_agents: Annotated[int, Field(ge=1, le=100_000)] = 1000
    max_step_sources: Annotated[int, Field(ge=2, le=1024)] = 64  # step-graph sources kept per agent and kind
    max_workflow_agents: Annotated[int, Field(ge=1, le=10_000)] = 64  # agents a plan's workflow names, nearest first
    # Planning runs on the event loop: past this much CPU time (plus 0.05 ms per message),
    # counted after the linear scan of the prompt for known texts,
    # the rest of a plan is skipped and the request goes on with what was planned
    # (counted as plans_over_budget).
    plan_budget_ms: Annotated[float, Field(gt=0, le=1000)] = 10.0
    # Tenants whose requests may reuse each other's cached KV, as groups (a pair, or more
    # that all share); a tenant in one group at most (kvrelay/gateway/tenancy.py).
    shared_caches: list[list[str]] = []

    @field_validator("shared_caches")
    @classmethod
    def _groups(cls, groups: list[list[str]]) -> list[list[str]]:
        TenantMap(groups)  # raises on a group of one or overlapping groups
        return groups

    @field_validator("separators", "fixed_prefix_delimiters")
    @classmethod
    def _non_empty(cls, markers: list[str]) -> list[str]:
        if any(not m for m in markers):
            raise ValueError("a delimiter cannot be empty")
        return markers


class AdapterRule(BaseModel):
    """Requests of matching agents run on `adapter` of the model the client named. Every
    condition given must hold: `agent` an fnmatch glob on the agent id (explicit or
    inferred), `system` a regex searched in the system/developer message, `base` the
    client's model (None: any)."""

    model_config = ConfigDict(extra="forbid")  # a misspelt condition must not match everything

    adapter: Annotated[str, Field(min_length=1, pattern=r"^[^:/]+$")]  # as the engine names adapters
    agent: Annotated[str, Field(min_length=1)] | None = None
    system: Annotated[str, Field(min_length=1)] | None = None
    base: Annotated[str, Field(min_length=1, pattern=r"^[^:]+$")] | None = None  # a base names no adapter

    @field_validator("system")
    @classmethod
    def _regex(cls, pattern: str | None) -> str | None:
        if pattern is not None:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"{pattern!r} is not a valid regular expression ({exc})") from exc
        return pattern

    @model_validator(mode="after")
    def _a_condition(self) -> AdapterRule:
        if self.agent is None and self.system is None:
            raise ValueError(f"the rule for adapter {self.adapter!r} needs `agent` or `system` (or both)")
        return self


class _AdapterFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rules: list[AdapterRule] = []


class AdapterSettings(BaseModel):
    """Which LoRA adapter an agent's requests run on: `rules` here, then those of the YAML
    `file` (`{rules: [...]}`), first match wins. The file is read once, when the settings
    are built, so a missing or invalid one stops the gateway at startup."""

    model_config = ConfigDict(extra="forbid")

    rules: list[AdapterRule] = []
    file: Path | None = None
    _file_rules: list[AdapterRule] = PrivateAttr(default_factory=list)

    @model_validator(mode="after")
    def _load_file(self) -> AdapterSettings:
        if self.file is not None:
            self._file_rules = load_adapter_rules(self.file)
        return self

    @property
    def all_rules(self) -> list[AdapterRule]:
        return [*self.rules, *self._file_rules]


def load_adapter_rules(path: Path) -> list[AdapterRule]:
    """The rules of an adapters file; ValueError naming the file and the problem."""
    return load_rule_file(path, _AdapterFile, "adapters").rules


class LimitSettings(BaseModel):
    """What one request may carry (kvrelay/gateway/limits.py); past a limit: 400 naming the field."""
    model_config = ConfigDict(extra="forbid")

    max_messages: Annotated[int, Field(ge=1, le=100_000)] = 1024
    max_message_chars: Annotated[int, Field(ge=1, le=64 * 2**20)] = 2 * 2**20


class ReplicationSettings(BaseModel):
    """Gateway replicas sharing what they infer through the database (every replica
    points at the same `database_url`; kvrelay/gateway/inference/replication.py). Off:
    one gateway, nothing shared, no extra service."""

    enabled: bool = False
    replica_id: Annotated[str | None, Field(min_length=1, max_length=64)] = None  # default: host, pid and a random tag
    # SQLite (replicas of one host): how often the doorbell file beside the database is
    # read (a few bytes; the log is read when it changed). PostgreSQL is woken by NOTIFY.
    poll_interval_s: Annotated[float, Field(gt=0, le=1)] = 0.002
    retention_s: Annotated[float, Field(ge=60)] = 3600.0  # shared observations older than this are deleted
    # Causal order across replicas: an answer's end reaches its client only once the answer
    # is in the log, and a request with news in the log waits to apply it before planning;
    # each wait at most this long (0: neither waits, sharing is eventual).
    barrier_ms: Annotated[float, Field(ge=0, le=1000)] = 100.0


class GatewaySettings(YamlFileSettings):
    # An empty variable (KVRELAY_ADMIN_KEY=) means "not set", as in most tools.
    model_config = SettingsConfigDict(env_prefix="KVRELAY_", env_nested_delimiter="__", extra="forbid",
                                      env_ignore_empty=True)
    yaml_variable = "KVRELAY_CONFIG"  # a YAML mapping read after the environment

    upstreams: Annotated[list[str], Field(min_length=1)] = ["http://127.0.0.1:8000"]
    database_url: str = "sqlite+aiosqlite:///kvrelay.db"
    store_content: bool = False  # prompt/completion text in the records: explicit opt-in
    max_body_bytes: Annotated[int, Field(ge=1024)] = 8 * 2**20
    limits: LimitSettings = LimitSettings()
    max_connections: Annotated[int, Field(ge=1)] = 512  # to all upstreams together
    keepalive_s: PositiveFloat = 15.0  # an idle upstream connection is kept this long
    # An idle client connection is kept this long: longer than what sits in front keeps
    # its own (nginx's upstream keepalive_timeout 60 s, cloud load balancers 60 s, SDKs
    # 5-15 s), so the gateway never closes a connection a proxy is about to send a POST on
    # (a proxy does not retry a POST: its client gets a 502). uvicorn's default is 5 s.
    client_keepalive_s: Annotated[int, Field(ge=1, le=3600)] = 75
    retries: Annotated[int, Field(ge=0, le=5)] = 2
    timeouts: Timeouts = Timeouts()
    breaker: Breaker = Breaker()
    inference: InferenceSettings = InferenceSettings()
    replication: ReplicationSettings = ReplicationSettings()
    adapters: AdapterSettings = AdapterSettings()  # agent -> LoRA adapter routing
    approximation: ApproximationSettings = ApproximationSettings()  # opt-in approximate reuse and its guard
    health_interval_s: PositiveFloat = 5.0
    health_timeouts: PositiveInt = 3  # health checks in a row that time out before an upstream is taken out
    load_guard_factor: Annotated[float, Field(ge=1)] = 2.0  # leave a session's upstream above this x mean load
    routing: RoutingSettings = RoutingSettings()
    record_queue_size: Annotated[int, Field(ge=1)] = 100_000
    record_batch_size: Annotated[int, Field(ge=1)] = 256
    # A batch waits this long for more records: one transaction for many requests, not one each.
    record_linger_ms: Annotated[float, Field(ge=0, le=1000)] = 20.0
    # Records not yet in SQL also go to journal files here, re-queued by the next start:
    # a killed process loses none (kvrelay/gateway/storage/journal.py). One directory per
    # process; unset: records wait in memory only.
    record_journal_dir: Path | None = None
    # access: client keys are created with `kvrelay keys create` or POST /admin/keys
    require_api_key: bool = False
    admin_key: SecretStr | None = None  # enables /admin; compared in constant time
    key_refresh_s: PositiveFloat = 5.0  # a key revoked elsewhere stops working within this
    default_requests_per_minute: PositiveInt | None = None  # for keys without their own limit
    default_tokens_per_minute: PositiveInt | None = None
    upstream_api_key: SecretStr | None = None  # sent to the upstreams as a bearer token
    # Shared with the engines: the gateway seals each plan with it, and an engine given
    # the same secret follows no other plan (kvrelay/wire/seal.py). Required by an
    # engine listening beyond loopback.
    plan_secret: SecretStr | None = None
    plan_max_age_s: float = Field(default=300.0, gt=0, le=86400)  # an older sealed plan is stale

    @model_validator(mode="after")
    def _shared_database(self) -> GatewaySettings:
        if self.replication.enabled and (":memory:" in self.database_url or self.database_url.rstrip("/").endswith(
                ("sqlite:", "sqlite+aiosqlite:"))):
            raise ValueError("replication needs a database the replicas share (a SQLite file or PostgreSQL), "
                             "not an in-memory one")
        return self

    @field_validator("plan_secret")
    @classmethod
    def _plan_secret_length(cls, secret: SecretStr | None) -> SecretStr | None:
        if secret is not None and len(secret.get_secret_value()) < 16:
            raise ValueError("plan_secret must be at least 16 characters")
        return secret

    @field_validator("admin_key")
    @classmethod
    def _admin_key_length(cls, key: SecretStr | None) -> SecretStr | None:
        if key is not None and len(key.get_secret_value()) < 16:
            raise ValueError("admin_key must be at least 16 characters")
        return key

    @field_validator("upstreams")
    @classmethod
    def _urls(cls, urls: list[str]) -> list[str]:
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"upstream {url!r} must be an http(s) URL")
        return [u.rstrip("/") for u in urls]
