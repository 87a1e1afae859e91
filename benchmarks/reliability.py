"""Reliability: load, faults and fuzzing against a real stack, with figures.

Two engines and a gateway run as CLI processes on loopback; nothing leaves the machine.

1. **Soak.** A bounded load generator sends a fixed number of streamed requests, 256 at
   once, each in its own session. It counts errors and checks that every request is
   recorded. The gateway's and the engines' RSS are read after a warm-up and at the end.
2. **Faults.** Each fault is injected, then checked:
   - an engine killed mid-stream: each broken stream ends with an error event, every
     request is recorded, and new requests fail over;
   - the gateway restarted mid-session: no row is lost or duplicated, and the session's
     structure is rebuilt from SQL;
   - memory pressure: an engine whose KV budget holds a fraction of the concurrent
     demand preempts, never runs out of memory, and gives the answers it gives alone;
   - a disk KV tier filled past its budget: it evicts, with no error;
   - PostgreSQL stopped under load: no row is lost. This runs only where a throwaway
     cluster is offered (KVRELAY_TEST_POSTGRES_URL / KVRELAY_TEST_PG_CTL, as
     `make test` provides).
3. **Fuzzing.** Schemathesis runs against the gateway's and an engine's OpenAPI. Then
   the field fuzzing (benchmarks/field_fuzz.py) sends hostile bodies (lone surrogates,
   NUL, bidi, huge and negative numbers, NaN, wrong types, deep nesting in every field)
   to a gateway and an engine of their own, 5,000 cases (400 with --quick) in batches,
   and checks the stack after each: no server error, one record per request, /ready,
   /health and /metrics answer, a normal request still works.
4. **State bound.** 100k distinct sessions (20k with --quick) go through structure
   inference in process; the sessions held must stay within `max_sessions`.

Targets: requests_recorded == requests_sent, server_errors 0, records_lost 0,
faults_survived == faults_injected, fuzz_cases >= 5,000 (the field fuzzing's; the
schemathesis cases are schema_fuzz_cases).
"""

from __future__ import annotations

import asyncio
import math
import os
import sqlite3
import subprocess
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import httpx

from benchmarks.common import BenchResult
from benchmarks.field_fuzz import FieldFuzzResult, run_field_fuzz
from benchmarks.fuzz import fuzz_openapi
from benchmarks.load import Outcome, chat_body, run_load, tally
from benchmarks.stack import Service, engine, gateway, kv_bytes_per_token

SECRET = "reliability-bench-" + "s" * 16
REQUEST_TOKENS = 64  # a pressure request's prompt (chat template included) and answer, roughly
PREFIX_TOKENS = 110  # a disk-tier request's system prompt, roughly
ADMIN = "reliability-admin-" + "a" * 16
FIELD_FUZZ = {False: (5000, 100), True: (400, 50)}  # quick -> (cases, cases per batch)
FIELD_FUZZ_CONCURRENCY = 8  # measured on 2 cores with the real model: 5.8 s per batch of 100, 6.4 s at 4
FAILURE_ROWS = 12  # the field fuzzing's kinds of failure shown in the table, most frequent first


class Fault(NamedTuple):
    name: str
    survived: bool
    detail: str


class Ledger:
    """Requests sent through the gateway, against the rows its database ends up with."""

    def __init__(self, db_path: Path | None, pg_url: str | None = None) -> None:
        self.db_path, self.pg_url = db_path, pg_url
        self.sent = 0

    def load(self, url: str, bodies: list[dict], headers: list[dict[str, str]] | None = None,
             concurrency: int = 1) -> list[Outcome]:
        self.sent += len(bodies)
        return asyncio.run(run_load(url, bodies, concurrency, headers))

    def recorded(self, timeout: float = 60.0) -> int:
        """Distinct request rows, once the writer has caught up (or `timeout` passed)."""
        deadline, count = time.monotonic() + timeout, -1
        while time.monotonic() < deadline:
            count = self._count()
            if count >= self.sent:
                return count
            time.sleep(0.2)
        return count

    def statuses(self, session_prefix: str, upstream: str) -> dict[str, int]:
        """Statuses of the rows of those sessions that went to `upstream` (SQLite ledgers)."""
        with sqlite3.connect(self.db_path) as conn:
            rows = conn.execute("SELECT status, count(*) FROM requests WHERE session_id LIKE ? AND upstream = ? "
                                "GROUP BY status", (f"{session_prefix}%", upstream)).fetchall()
        return dict(rows)

    def _count(self) -> int:
        if self.pg_url is None:
            with sqlite3.connect(self.db_path) as conn:
                return conn.execute("SELECT count(DISTINCT id) FROM requests").fetchone()[0]
        import asyncpg  # the gateway's own driver

        async def count() -> int:
            conn = await asyncpg.connect(self.pg_url.replace("postgresql+asyncpg", "postgresql"))
            try:
                return await conn.fetchval("SELECT count(DISTINCT id) FROM requests")
            finally:
                await conn.close()
        return asyncio.run(count())


def _bodies(n: int, tag: str, max_tokens: int = 4) -> tuple[list[dict], list[dict[str, str]]]:
    bodies = [chat_body(f"{tag} request {i}: name one colour.", max_tokens) for i in range(n)]
    return bodies, [{"x-kvrelay-session-id": f"{tag}-{i}"} for i in range(n)]


def _engine_killed_mid_stream(ledger: Ledger, gw: Service, victim: Service) -> Fault:
    """SIGKILL one engine while streams run on both: each of its streams must end with an
    error event (never hang or stop silently), every request is recorded, and the next
    requests all succeed on the other engine."""
    ready = _wait_available(gw, 2)  # the precondition: streams can land on both engines
    bodies, headers = _bodies(32, "kill", max_tokens=256)
    first_chunks = _streams_answered(gw)
    loop = asyncio.new_event_loop()
    task = loop.create_task(run_load(gw.url, bodies, 32, headers))
    ledger.sent += len(bodies)
    # Mid-stream means past the first chunk: a request the victim has not answered yet is
    # rightly retried on the other engine. 24 of 32 answered, spread by load, puts some on both.
    deadline = time.monotonic() + 60
    while _streams_answered(gw) - first_chunks < 24 and time.monotonic() < deadline:
        loop.run_until_complete(asyncio.sleep(0.05))
    answered = _streams_answered(gw) - first_chunks
    victim.kill()
    during = tally(loop.run_until_complete(task))
    loop.close()
    after_bodies, after_headers = _bodies(32, "after-kill")
    after = tally(ledger.load(gw.url, after_bodies, after_headers, concurrency=16))
    recorded = ledger.recorded()
    broken, on_victim = during.get("error_event", 0), ledger.statuses("kill-", victim.url)
    # Every stream the killed engine carried ended with an error event, and its row says so.
    survived = set(during) <= {"ok", "error_event"} and broken > 0 and on_victim == {"upstream_error": broken} \
        and after == {"ok": 32} and recorded >= ledger.sent
    return Fault("engine killed mid-stream", survived,
                 f"{ready} upstreams available before; killed with {answered:g} streams answered; "
                 f"during: {dict(during)}; rows of the killed engine's streams: {on_victim}; "
                 f"after: {dict(after)}; recorded {recorded}/{ledger.sent}")


def _wait_available(gw: Service, want: int, timeout: float = 20.0) -> int:
    """Wait (up to `timeout`) until `want` upstreams are healthy with their breakers
    closed, as the gateway sees them; how many are."""
    deadline, available = time.monotonic() + timeout, 0
    while time.monotonic() < deadline:
        listing = httpx.get(f"{gw.url}/admin/upstreams", headers={"Authorization": f"Bearer {ADMIN}"}).json()
        available = sum(u["healthy"] and not u["breaker_open"] for u in listing["data"])
        if available >= want:
            break
        time.sleep(0.2)
    return available


def _streams_answered(gw: Service) -> float:
    """Requests whose first content chunk the gateway has relayed (its TTFT count)."""
    return sum(float(line.split()[-1]) for line in httpx.get(f"{gw.url}/metrics").text.splitlines()
               if line.startswith("kvrelay_ttft_seconds_count"))


def _gateway_restarted_mid_session(ledger: Ledger, gw: Service) -> Fault:
    system = "You are the harbour master. Answer in one sentence."
    turns = [chat_body(f"Turn {i}: which ship docks next?", 4, system) for i in range(8)]
    session = {"x-kvrelay-session-id": "restart-session", "x-kvrelay-agent-id": "harbour"}
    first = tally(ledger.load(gw.url, turns[:4], [session] * 4))
    gw.stop()
    gw.start()
    second = tally(ledger.load(gw.url, turns[4:], [session] * 4))
    detail = httpx.get(f"{gw.url}/admin/sessions/restart-session", headers={"Authorization": f"Bearer {ADMIN}"})
    rebuilt = detail.status_code == 200 and detail.json()["num_requests"] >= 8
    recorded = ledger.recorded()
    survived = first == second == {"ok": 4} and rebuilt and recorded == ledger.sent
    return Fault("gateway restarted mid-session", survived,
                 f"turns ok {first.get('ok', 0)}+{second.get('ok', 0)}; session rebuilt: {rebuilt}; "
                 f"recorded {recorded}/{ledger.sent}")


def _direct(url: str, bodies: list[dict], concurrency: int) -> list[Outcome]:
    return asyncio.run(run_load(url, bodies, concurrency))


def _memory_pressure(model: str, log_dir: Path) -> Fault:
    """Three times the concurrent demand the KV budget holds (the budget fits one request
    with room to spare): the engine must preempt and still answer as it does alone."""
    budget_mb = max(1, math.ceil(REQUEST_TOKENS * 2.5 * kv_bytes_per_token(model) / 2**20))
    budget_tokens = budget_mb * 2**20 // kv_bytes_per_token(model)
    n = max(8, math.ceil(3 * budget_tokens / REQUEST_TOKENS))
    tight = engine("engine-tight", model, log_dir, SECRET, "--kv-cache-mb", str(budget_mb)).start()
    try:
        bodies = [chat_body(f"Pressure {i}: list three harbour towns and their ships.", 24) for i in range(n)]
        alone = _direct(tight.url, bodies, 1)
        crowded = _direct(tight.url, bodies, n)
    finally:
        tight.stop()
    kinds = tally(crowded)
    differing = sum(a.text != c.text for a, c in zip(alone, crowded))
    survived = kinds == {"ok": n} and tally(alone) == {"ok": n} and differing == 0
    return Fault("engine memory pressure", survived,
                 f"{n} at once on a {budget_tokens}-token KV budget: {dict(kinds)}; answers differing: {differing}")


def _disk_tier_full(model: str, log_dir: Path) -> Fault:
    """More distinct fixed prefixes than the device, host (1 MiB) and disk (2 MiB) tiers
    hold together, twice over: the tiers evict to stay within budget, no request fails,
    and the second pass (prefixes loaded back, or recomputed once evicted everywhere)
    answers as the first did."""
    per_token = kv_bytes_per_token(model)
    device_mb = max(1, math.ceil(3 * PREFIX_TOKENS * per_token / 2**20))
    held_tokens = (device_mb + 3) * 2**20 // per_token  # device + host 1 MiB + disk 2 MiB
    n = min(max(6, math.ceil(2 * held_tokens / PREFIX_TOKENS)), 160)
    tiered = engine("engine-tiers", model, log_dir, SECRET, "--kv-cache-mb", str(device_mb), "--host-kv-mb", "1",
                    "--disk-kv-dir", str(log_dir / "kv-disk"), "--disk-kv-mb", "2").start()
    try:
        systems = [f"You are clerk {i} of the customs house. " + "Keep the ledger of every ship. " * 12
                   for i in range(n)]
        bodies = [chat_body("Which ship came in?", 4, s) for s in systems]
        first, second = _direct(tiered.url, bodies, 4), _direct(tiered.url, bodies, 4)
        healthy = httpx.get(f"{tiered.url}/health").status_code == 200
    finally:
        tiered.stop()
    differing = sum(a.text != b.text for a, b in zip(first, second))
    survived = tally(first + second) == {"ok": 2 * n} and differing == 0 and healthy
    return Fault("disk KV tier past its budget", survived,
                 f"{n} prefixes, ~{n * PREFIX_TOKENS} tokens for {held_tokens} held, twice: "
                 f"{dict(tally(first + second))}; second pass differing: {differing}")


def _postgres_outage(model_url: str, log_dir: Path, quick: bool) -> Fault | None:
    pg_url, pg_ctl = os.environ.get("KVRELAY_TEST_POSTGRES_URL"), os.environ.get("KVRELAY_TEST_PG_CTL")
    if not pg_url or not pg_ctl:
        return None
    gw = gateway([model_url], pg_url, log_dir, SECRET, ADMIN).start()
    ledger = Ledger(None, pg_url)
    ledger.sent = ledger._count()  # rows already there count as sent
    try:
        subprocess.run(f"{pg_ctl} -m fast stop", shell=True, check=True, capture_output=True)
        outage_end = time.monotonic() + (10 if quick else 30)
        outcomes: list[Outcome] = []
        while time.monotonic() < outage_end:
            bodies, headers = _bodies(8, f"pg-{len(outcomes)}")
            outcomes += ledger.load(gw.url, bodies, headers, concurrency=8)
        subprocess.run(f"{pg_ctl} -w start", shell=True, check=True, capture_output=True)
        recorded = ledger.recorded(timeout=120)
    finally:
        subprocess.run(f"{pg_ctl} -w start", shell=True, capture_output=True)  # never leave it stopped
        gw.stop()
    survived = tally(outcomes) == {"ok": len(outcomes)} and recorded == ledger.sent
    return Fault("PostgreSQL stopped under load", survived,
                 f"{len(outcomes)} requests during the outage; recorded {recorded}/{ledger.sent}")


def _session_bound(num_sessions: int) -> tuple[int, int]:
    """Sessions held after `num_sessions` distinct ones went through inference, and the bound."""
    from kvrelay.gateway.identity import identify
    from kvrelay.gateway.inference import Inference
    from kvrelay.gateway.settings import InferenceSettings

    inference = Inference(InferenceSettings())
    for i in range(num_sessions):
        body = {"messages": [{"role": "user", "content": f"session {i} asks about the tides"}]}
        inference.plan(identify({"x-kvrelay-session-id": f"s{i}"}, body, None), body, f"r{i}", "m")
    return len(inference.apps["default"].sessions), inference.settings.max_sessions


def run(quick: bool = False, model: str | None = None) -> BenchResult:
    from engine_ext.model_store import prepare_default_model

    model = model or str(prepare_default_model(progress=False))
    num_soak = 256 if quick else 2048
    log_dir = Path(tempfile.mkdtemp(prefix="kvrelay-reliability-"))
    db_path = log_dir / "gateway.sqlite"
    engines = [engine(f"engine-{k}", model, log_dir, SECRET).start() for k in ("a", "b")]
    gw = gateway([e.url for e in engines], f"sqlite+aiosqlite:///{db_path}", log_dir, SECRET, ADMIN).start()
    ledger = Ledger(db_path)
    faults: list[Fault] = []
    try:
        ledger.load(gw.url, *_bodies(32, "warm"), concurrency=32)
        services = [gw, *engines]
        rss_start = [s.rss_mb() for s in services]
        started = time.perf_counter()
        soak = ledger.load(gw.url, *_bodies(num_soak, "soak"), concurrency=256)
        soak_s = time.perf_counter() - started
        rss_end = [s.rss_mb() for s in services]
        # Fuzzed against a gateway of its own: its requests are not the ledger's.
        fuzz_gw = gateway([engines[0].url], f"sqlite+aiosqlite:///{log_dir / 'fuzz.sqlite'}", log_dir, SECRET,
                          ADMIN, name="gateway-fuzz").start()
        try:
            gw_fuzz = fuzz_openapi(f"{fuzz_gw.url}/openapi.json", examples=10 if quick else 50,
                                   headers={"Authorization": f"Bearer {ADMIN}"})
        finally:
            fuzz_gw.stop()
        engine_fuzz = fuzz_openapi(f"{engines[0].url}/openapi.json", examples=10 if quick else 50)
        faults.append(_engine_killed_mid_stream(ledger, gw, engines[1]))
        faults.append(_gateway_restarted_mid_session(ledger, gw))
        recorded = ledger.recorded()
        pg = _postgres_outage(engines[0].url, log_dir, quick)
    finally:
        gw.stop()
        for e in engines:
            e.stop()
    faults += [f for f in (pg, _memory_pressure(model, log_dir), _disk_tier_full(model, log_dir)) if f is not None]
    num_cases, batch_size = FIELD_FUZZ[quick]
    field = run_field_fuzz(model, log_dir / "field-fuzz", num_cases, batch_size, concurrency=FIELD_FUZZ_CONCURRENCY)
    held, bound = _session_bound(20_000 if quick else 100_000)
    soak_errors = sum(n for kind, n in tally(soak).items() if kind != "ok")
    growth = [100.0 * (end - start) / start for start, end in zip(rss_start, rss_end)]
    metrics = {
        "requests_sent": ledger.sent, "requests_recorded": recorded, "errors": soak_errors,
        "faults_injected": len(faults), "faults_survived": sum(f.survived for f in faults),
        "fuzz_cases": field.cases, "schema_fuzz_cases": gw_fuzz.num_cases + engine_fuzz.num_cases,
        "server_errors": gw_fuzz.num_server_errors + engine_fuzz.num_server_errors + field.server_errors
        + sum(n for kind, n in tally(soak).items() if kind.startswith("http_5")),
        "records_lost": field.records_lost + max(ledger.sent - recorded, 0), "records_extra": field.records_extra,
        "fuzz_timeouts": field.timeouts, "fuzz_broken_batches": field.broken_batches,
        "fuzz_s_per_batch": field.seconds_per_batch,
        "schema_violations": len(gw_fuzz.failures) + len(engine_fuzz.failures)
        - gw_fuzz.num_server_errors - engine_fuzz.num_server_errors,
        "rss_growth_pct": max(growth), "soak_requests_per_s": num_soak / soak_s,
        "sessions_held": held, "sessions_bound": bound,
    }
    n_sessions = 20_000 if quick else 100_000

    def row(measure: str, value: object, target: str, met: bool | None) -> tuple[str, str, str, str]:
        return measure, str(value), target, "" if met is None else ("yes" if met else "NO")

    rows = [
        row(f"soak: {num_soak} streamed requests, 256 at once: errors", soak_errors, "0", soak_errors == 0),
        row("requests recorded / sent", f"{recorded} / {ledger.sent}", "equal", recorded == ledger.sent),
        row("server errors (schemathesis + field fuzz + soak)", metrics["server_errors"], "0",
            metrics["server_errors"] == 0),
        row("records lost (soak and faults + field fuzz)", metrics["records_lost"], "0", metrics["records_lost"] == 0),
        row("schema violations (schemathesis)", metrics["schema_violations"], "0", metrics["schema_violations"] == 0),
        row("schemathesis cases (gateway + engine)", metrics["schema_fuzz_cases"], "", None),
        *_field_fuzz_rows(field, num_cases, batch_size),
        row("faults survived / injected", f"{metrics['faults_survived']} / {len(faults)}", "equal",
            metrics["faults_survived"] == len(faults)),
        *(row(f"  fault: {f.name}", "survived" if f.survived else "FAILED", f.detail, f.survived) for f in faults),
        row("RSS MiB after warm-up -> after soak (gateway, engine a, engine b)",
            ", ".join(f"{a:.0f}->{b:.0f}" for a, b in zip(rss_start, rss_end)), "", None),
        row("RSS growth %, largest", f"{max(growth):+.1f}", "", None),
        row(f"sessions held after {n_sessions} distinct", held, f"<= {bound}", held <= bound),
    ]
    config = {"quick": quick, "model": model, "soak_requests": num_soak, "concurrency": 256,
              "postgres_fault": pg is not None, "logs": str(log_dir), "field_fuzz_cases": num_cases,
              "field_fuzz_batch": batch_size}
    return BenchResult("reliability", metrics, config, rows, ("measure", "measured", "target", "met"))


def _field_fuzz_rows(field: FieldFuzzResult, num_cases: int, batch_size: int) -> list[tuple[str, str, str, str]]:
    """The field fuzzing's figures, then its most frequent kinds of failure with an example each."""
    rows = [
        ("field fuzz: cases to the gateway (those it refuses to the engine too)", str(field.cases), f">= {num_cases}",
         "yes" if field.cases >= num_cases else "NO"),
        ("  server errors (5xx, server error events, broken replies)", str(field.server_errors), "0",
         "yes" if field.server_errors == 0 else "NO"),
        ("  requests without exactly one record", f"{field.records_lost} lost, {field.records_extra} extra", "0",
         "yes" if field.records_lost == field.records_extra == 0 else "NO"),
        ("  batches after which a stack check failed", str(field.broken_batches), "0",
         "yes" if field.broken_batches == 0 else "NO"),
        ("  requests with no answer in time", str(field.timeouts), "0", "yes" if field.timeouts == 0 else "NO"),
        (f"  seconds per batch of {batch_size}", f"{field.seconds_per_batch:.2f}", "", ""),
    ]
    # Failures that a case causes alone first: the others are often their consequences
    # (an engine step that fails fails its batch; the gateway's breaker then opens).
    worst = sorted(field.failures.items(), key=lambda item: (item[1].alone is not True, -item[1].count))
    worst = worst[:FAILURE_ROWS]
    rows += [(f"  fuzz failure: {key[:120]}", f"{f.count}x", f"{f.example[:300]} {f.note}".strip(), "NO")
             for key, f in worst]
    return rows
