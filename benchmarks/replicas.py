"""Gateway replicas: does what one gateway infers survive being spread over several?

The captured agent traffic (the short and the long-context families) is sent through 1,
2 and 3 gateway processes that share one database, requests spread round-robin across
them as a load balancer would, each request sent as long after the answers it waits for
as its app did in the capture (the client's own time, 3 ms to 0.6 s). An upstream
answers every captured prompt with its captured answer (benchmarks/capture_upstream.py),
so every configuration sees exactly the traffic the capture's ground truth describes.
What each replica inferred is read back from the shared request records and scored
against that truth (benchmarks/agents/scoring.py); the baseline is three replicas that
share nothing, what running several gateways means without this.

Metrics: `placeholder_f1_drop_max`, `session_rand_drop_max` and `next_agent_drop_max`
(one replica's score minus the worst of 2 and 3, the larger of the two families);
`reuse_drop_max` (the plans' placed tokens, fixed prefixes, placeholders and shared
blocks, relative); `staleness_p99_ms` (the largest p99 any replica saw, from /metrics).
The database is a SQLite file (replicas of one host); outside `--quick`, with `KVRELAY_BENCH_POSTGRES_URL`
(or the test suite's `KVRELAY_TEST_POSTGRES_URL`) set, PostgreSQL is measured too.
"""

from __future__ import annotations

import os
import re
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from benchmarks.agents.bench import interleaved
from benchmarks.agents.long import LONG_CAPTURES
from benchmarks.agents.replay import Outcome, Replay
from benchmarks.agents.scoring import InferenceScores, Record, observed_from, score
from benchmarks.agents.workload import CAPTURES, Workload, load_all
from benchmarks.capture_upstream import MODEL
from benchmarks.common import BenchResult, free_port, wait_healthy
from kvrelay.gateway.storage import migrate

REPLICAS = (1, 2, 3)
CONCURRENCY = 4  # runs in flight at once
_SHARED_KINDS = ("fixed_prefix", "placeholder", "shared_block")
_STALENESS = re.compile(r'^kvrelay_replication_staleness_ms\{quantile="([0-9.]+)"\} ([0-9.eE+-]+)$', re.M)


@dataclass
class Cell:
    family: str
    database: str
    replicas: int
    shared: bool
    scores: InferenceScores
    placed_tokens: float
    errors: int
    unknown_prompts: int
    staleness_p50_ms: float | None
    staleness_p99_ms: float | None
    seconds: float

    @property
    def label(self) -> str:
        return f"{self.family}, {self.database}, {self.replicas} {'shared' if self.shared else 'share nothing'}"


@contextmanager
def _process(args: list[str], port: int, env: dict[str, str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, *args], env={**os.environ, **env}, stdout=out, stderr=out)
    try:
        wait_healthy(proc, port, log.read_text)
        yield proc
    finally:
        proc.terminate()
        proc.wait(20)


def _gateways(stack: ExitStack, count: int, upstream: str, database_url: str, shared: bool, log_dir: Path) -> list[str]:
    urls = []
    for n in range(count):
        port = free_port()
        env = {"KVRELAY_UPSTREAMS": f'["{upstream}"]', "KVRELAY_DATABASE_URL": database_url,
               "KVRELAY_REPLICATION__ENABLED": "true" if shared else "false",
               "KVRELAY_REPLICATION__REPLICA_ID": f"replica-{n}", "KVRELAY_INFERENCE__FLUSH_INTERVAL_S": "0.5"}
        stack.enter_context(_process(["-m", "uvicorn", "kvrelay.gateway.app:create_app", "--factory", "--port",
                                      str(port), "--log-level", "warning"], port, env, log_dir / f"gateway-{n}.log"))
        urls.append(f"http://127.0.0.1:{port}")
    return urls


def _staleness(urls: list[str]) -> tuple[float | None, float | None]:
    p50: list[float] = []
    p99: list[float] = []
    for url in urls:
        for quantile, value in _STALENESS.findall(httpx.get(f"{url}/metrics", timeout=10).text):
            (p50 if quantile == "0.5" else p99 if quantile == "0.99" else []).append(float(value))
    return (max(p50) if p50 else None), (max(p99) if p99 else None)


def _records(database_url: str) -> dict[str, Record]:
    if database_url.startswith("sqlite"):
        import json
        with sqlite3.connect(database_url.split("///", 1)[1]) as db:
            rows = db.execute("SELECT id, session_id, agent_id, plan FROM requests").fetchall()
        return {rid: Record(s, a, json.loads(p) if p else None) for rid, s, a, p in rows}
    import asyncio
    import json

    from sqlalchemy import text
    from sqlalchemy.ext.asyncio import create_async_engine

    async def read() -> list[Any]:
        engine = create_async_engine(database_url)
        async with engine.connect() as conn:
            rows = (await conn.execute(text("SELECT id, session_id, agent_id, plan FROM requests"))).all()
        await engine.dispose()
        return list(rows)

    return {r[0]: Record(r[1], r[2], json.loads(r[3]) if r[3] else None) for r in asyncio.run(read())}


def _placed_tokens(records: dict[str, Record], outcomes: dict[Any, Outcome]) -> float:
    chars = 0
    for outcome in outcomes.values():
        plan = records.get(outcome.request_id or "", Record(None, None, None)).plan or {}
        chars += sum(s["char_end"] - s["char_start"] for s in plan.get("segments", []) if s["kind"] in _SHARED_KINDS)
    return chars / 4  # about four characters a token


class Bench:
    def __init__(self, quick: bool, log_dir: Path) -> None:
        self.quick = quick
        self.log_dir = log_dir
        self.cells: list[Cell] = []

    def databases(self) -> dict[str, str | None]:
        """SQLite always; PostgreSQL too when one is named (not in --quick)."""
        pg = os.environ.get("KVRELAY_BENCH_POSTGRES_URL") or os.environ.get("KVRELAY_TEST_POSTGRES_URL")
        return {"sqlite": None, **({"postgresql": pg} if pg and not self.quick else {})}

    def cell(self, family: str, workloads: list[Workload], upstream: str, database: str, pg_url: str | None,
             replicas: int, shared: bool) -> Cell:
        tag = f"{family}-{database}-{replicas}-{'shared' if shared else 'alone'}"
        if pg_url is None:
            url = f"sqlite+aiosqlite:///{self.log_dir / tag}.sqlite"
        else:
            url = pg_url
            migrate.downgrade(url, "base")  # a clean schema for every cell
        migrate.upgrade(url)
        fixed = {r.key: (r.body, r.quotes) for w in workloads for r in w.requests}
        started = time.perf_counter()
        with ExitStack() as stack:
            urls = _gateways(stack, replicas, upstream, url, shared, self.log_dir)
            outcomes = Replay(urls, MODEL, interleaved(workloads), CONCURRENCY, fixed, keep_gaps=True).run()
            seconds = time.perf_counter() - started
            p50, p99 = _staleness(urls) if shared and replicas > 1 else (None, None)
            unknown = int(httpx.get(f"{upstream}/stats", timeout=10).json()["unknown"])
        records = _records(url)  # the gateways have stopped: every record is written
        scores = score(workloads, observed_from(outcomes, records))
        errors = sum(1 for o in outcomes.values() if not o.ok)
        cell = Cell(family, database, replicas, shared, scores, _placed_tokens(records, outcomes), errors, unknown,
                    p50, p99, seconds)
        print(f"  {cell.label}: {len(outcomes)} requests in {seconds:.1f}s, ph_f1 {scores.placeholder_f1:.3f}, "
              f"session {scores.session_rand:.3f}, next {scores.next_agent_acc:.3f}, placed "
              f"{cell.placed_tokens:.0f}, staleness p99 {p99}", flush=True)
        return cell

    def run(self) -> BenchResult:
        families = {"short": load_all(CAPTURES), "long": load_all(LONG_CAPTURES)}
        for family, workloads in families.items():
            for database, pg_url in self.databases().items():
                for replicas, shared in [(n, True) for n in REPLICAS] + [(3, False)]:
                    port = free_port()  # a fresh upstream per cell: recurring prompts answered from the start
                    with _process(["-m", "benchmarks.capture_upstream", "--port", str(port), "--family", family],
                                  port, {}, self.log_dir / "upstream.log"):
                        self.cells.append(self.cell(family, workloads, f"http://127.0.0.1:{port}", database, pg_url,
                                                    replicas, shared))
        return self.result()

    def result(self) -> BenchResult:
        metrics: dict[str, float] = {}
        rows: list[tuple[str, str, str, str]] = []
        drops: dict[str, list[float]] = {"placeholder_f1": [], "session_rand": [], "next_agent": [], "reuse": []}
        for family in ("short", "long"):
            for database in self.databases():
                group = [c for c in self.cells if c.family == family and c.database == database]
                one = next((c for c in group if c.replicas == 1), None)
                many = [c for c in group if c.replicas > 1 and c.shared]
                alone = next((c for c in group if not c.shared), None)
                if one is None or not many:
                    continue
                worst = {"placeholder_f1": min(c.scores.placeholder_f1 for c in many),
                         "session_rand": min(c.scores.session_rand for c in many),
                         "next_agent": min(c.scores.next_agent_acc for c in many),
                         "reuse": min(c.placed_tokens for c in many)}
                base = {"placeholder_f1": one.scores.placeholder_f1, "session_rand": one.scores.session_rand,
                        "next_agent": one.scores.next_agent_acc, "reuse": one.placed_tokens}
                for name in drops:
                    drop = base[name] - worst[name]
                    drops[name].append(drop / base[name] if name == "reuse" and base[name] else drop)
                for c in group:
                    metrics[f"{family}_{database}_{c.replicas}{'' if c.shared else '_alone'}_placeholder_f1"] = \
                        c.scores.placeholder_f1
                    metrics[f"{family}_{database}_{c.replicas}{'' if c.shared else '_alone'}_session_rand"] = \
                        c.scores.session_rand
                    metrics[f"{family}_{database}_{c.replicas}{'' if c.shared else '_alone'}_next_agent_acc"] = \
                        c.scores.next_agent_acc
                    metrics[f"{family}_{database}_{c.replicas}{'' if c.shared else '_alone'}_placed_tokens"] = \
                        c.placed_tokens
                    reference = alone if alone is not None and c is not alone else None
                    rows.append((f"{c.label}: placeholder F1 / session Rand / next agent / placed tokens",
                                 f"{c.scores.placeholder_f1:.3f} / {c.scores.session_rand:.3f} / "
                                 f"{c.scores.next_agent_acc:.3f} / {c.placed_tokens:.0f}",
                                 "" if reference is None else
                                 f"{reference.scores.placeholder_f1:.3f} / {reference.scores.session_rand:.3f} / "
                                 f"{reference.scores.next_agent_acc:.3f} / {reference.placed_tokens:.0f}",
                                 "" if reference is None or not reference.placed_tokens else
                                 f"{c.placed_tokens / reference.placed_tokens:.2f}x placed"))
                    if c.staleness_p99_ms is not None:
                        rows.append((f"{c.label}: staleness p50 / p99 ms", f"{c.staleness_p50_ms:.1f} / "
                                     f"{c.staleness_p99_ms:.1f}", "", ""))
                    if c.errors or c.unknown_prompts:
                        rows.append((f"{c.label}: failed requests / prompts the capture lacks",
                                     f"{c.errors} / {c.unknown_prompts}", "", ""))
        for name, values in drops.items():
            if values:
                metrics[f"{name}_drop_max"] = max(values)
        stale = [c.staleness_p99_ms for c in self.cells if c.staleness_p99_ms is not None]
        if stale:
            metrics["staleness_p99_ms"] = max(stale)
        metrics["failed_requests"] = float(sum(c.errors for c in self.cells))
        config = {"replicas": list(REPLICAS), "concurrency": CONCURRENCY, "databases": list(self.databases()),
                  "baseline": "3 replicas sharing nothing", "gaps": "as captured", "quick": self.quick,
                  "cells": [{"label": c.label, "seconds": round(c.seconds, 2), "requests": c.scores.scored}
                            for c in self.cells]}
        return BenchResult("replicas", metrics, config, rows,
                           ("measure", "kvrelay replicas", "baseline (3, share nothing)", "ratio"))


def run(quick: bool = False, model: str | None = None) -> BenchResult:
    with tempfile.TemporaryDirectory(prefix="kvrelay-bench-replicas-") as tmp:
        return Bench(quick, Path(tmp)).run()
