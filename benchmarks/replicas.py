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
The replay runs four sessions at once, and how their requests interleave changes what can
be linked: the same configuration scores differently from run to run (one replica's
placeholder F1 moved by 0.1 between runs). So every configuration runs `repeats` times
(2 in --quick, 3 otherwise), each on a fresh database and upstream, the configurations
taking turns so a slow spell of the machine hits them alike; the drops are computed on
the means, and each configuration's range over its runs is printed with it.
The database is a SQLite file (replicas of one host); outside `--quick`, with `KVRELAY_BENCH_POSTGRES_URL`
(or the test suite's `KVRELAY_TEST_POSTGRES_URL`) set, PostgreSQL is measured too.
"""

from __future__ import annotations

import os
import re
import sqlite3
import statistics
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
REPEATS = {True: 2, False: 3}  # runs of each configuration, by --quick
_SCORES = {"placeholder_f1": "placeholder_f1", "session_rand": "session_rand", "next_agent": "next_agent_acc"}
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
    repeat: int = 0

    @property
    def config(self) -> tuple[str, str, int, bool]:
        return self.family, self.database, self.replicas, self.shared

    @property
    def label(self) -> str:
        return f"{self.family}, {self.database}, {self.replicas} {'shared' if self.shared else 'share nothing'}"

    def measure(self, name: str) -> float:
        return self.placed_tokens if name == "reuse" else float(getattr(self.scores, _SCORES[name]))


@dataclass
class Summary:
    """One configuration over its repeated runs."""

    runs: list[Cell]

    @property
    def first(self) -> Cell:
        return self.runs[0]

    def mean(self, name: str) -> float:
        return statistics.fmean(c.measure(name) for c in self.runs)

    def spread(self, name: str) -> float:
        values = [c.measure(name) for c in self.runs]
        return max(values) - min(values)

    def staleness(self) -> tuple[float | None, float | None]:
        p50 = [c.staleness_p50_ms for c in self.runs if c.staleness_p50_ms is not None]
        p99 = [c.staleness_p99_ms for c in self.runs if c.staleness_p99_ms is not None]
        return (max(p50) if p50 else None), (max(p99) if p99 else None)

    def shown(self) -> str:
        """Means, and the range over the runs when there are several."""
        parts = []
        for name, digits in (("placeholder_f1", 3), ("session_rand", 3), ("next_agent", 3), ("reuse", 0)):
            part = f"{self.mean(name):.{digits}f}"
            if len(self.runs) > 1:
                part += f" (±{self.spread(name) / 2:.{digits}f})"
            parts.append(part)
        return " / ".join(parts)


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
             replicas: int, shared: bool, repeat: int) -> Cell:
        tag = f"{family}-{database}-{replicas}-{'shared' if shared else 'alone'}-{repeat}"
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
                    p50, p99, seconds, repeat)
        print(f"  {cell.label}, run {repeat + 1}: {len(outcomes)} requests in {seconds:.1f}s, ph_f1 {scores.placeholder_f1:.3f}, "
              f"session {scores.session_rand:.3f}, next {scores.next_agent_acc:.3f}, placed "
              f"{cell.placed_tokens:.0f}, staleness p99 {p99}", flush=True)
        return cell

    def run(self) -> BenchResult:
        families = {"short": load_all(CAPTURES), "long": load_all(LONG_CAPTURES)}
        for family, workloads in families.items():
            for database, pg_url in self.databases().items():
                for repeat in range(REPEATS[self.quick]):
                    for replicas, shared in [(n, True) for n in REPLICAS] + [(3, False)]:
                        port = free_port()  # a fresh upstream per cell: recurring prompts answered from the start
                        with _process(["-m", "benchmarks.capture_upstream", "--port", str(port), "--family", family],
                                      port, {}, self.log_dir / "upstream.log"):
                            self.cells.append(self.cell(family, workloads, f"http://127.0.0.1:{port}", database,
                                                        pg_url, replicas, shared, repeat))
        return self.result()

    def summaries(self) -> dict[tuple[str, str, int, bool], Summary]:
        grouped: dict[tuple[str, str, int, bool], Summary] = {}
        for cell in self.cells:
            grouped.setdefault(cell.config, Summary([])).runs.append(cell)
        return grouped

    def result(self) -> BenchResult:
        metrics: dict[str, float] = {}
        rows: list[tuple[str, str, str, str]] = []
        drops: dict[str, list[float]] = {name: [] for name in ("placeholder_f1", "session_rand", "next_agent", "reuse")}
        summaries = self.summaries()
        for family in ("short", "long"):
            for database in self.databases():
                group = [s for (f, d, _, _), s in summaries.items() if (f, d) == (family, database)]
                one = next((s for s in group if s.first.replicas == 1), None)
                many = [s for s in group if s.first.replicas > 1 and s.first.shared]
                alone = next((s for s in group if not s.first.shared), None)
                if one is None or not many:
                    continue
                for name in drops:
                    drop = one.mean(name) - min(s.mean(name) for s in many)
                    drops[name].append(drop / one.mean(name) if name == "reuse" and one.mean(name) else drop)
                for summary in group:
                    rows += self._rows(summary, alone if summary is not alone else None)
                    c = summary.first
                    key = f"{family}_{database}_{c.replicas}{'' if c.shared else '_alone'}"
                    for name, metric in (("placeholder_f1", "placeholder_f1"), ("session_rand", "session_rand"),
                                         ("next_agent", "next_agent_acc"), ("reuse", "placed_tokens")):
                        metrics[f"{key}_{metric}"] = summary.mean(name)
                        if len(summary.runs) > 1:
                            metrics[f"{key}_{metric}_range"] = summary.spread(name)
        for name, values in drops.items():
            if values:
                metrics[f"{name}_drop_max"] = max(values)
        stale = [p99 for s in summaries.values() if (p99 := s.staleness()[1]) is not None]
        if stale:
            metrics["staleness_p99_ms"] = max(stale)
        metrics["failed_requests"] = float(sum(c.errors for c in self.cells))
        config = {"replicas": list(REPLICAS), "concurrency": CONCURRENCY, "databases": list(self.databases()),
                  "repeats": REPEATS[self.quick], "drops": "on the means of the repeated runs",
                  "baseline": "3 replicas sharing nothing", "gaps": "as captured", "quick": self.quick,
                  "cells": [{"label": c.label, "run": c.repeat + 1, "seconds": round(c.seconds, 2),
                             "requests": c.scores.scored, "placeholder_f1": round(c.scores.placeholder_f1, 4),
                             "session_rand": round(c.scores.session_rand, 4),
                             "next_agent_acc": round(c.scores.next_agent_acc, 4), "placed_tokens": c.placed_tokens}
                            for c in self.cells]}
        return BenchResult("replicas", metrics, config, rows,
                           ("measure", "kvrelay replicas", "baseline (3, share nothing)", "ratio"))

    @staticmethod
    def _rows(summary: Summary, alone: Summary | None) -> list[tuple[str, str, str, str]]:
        c = summary.first
        runs = f", mean of {len(summary.runs)}" if len(summary.runs) > 1 else ""
        rows = [(f"{c.label}: placeholder F1 / session Rand / next agent / placed tokens{runs}", summary.shown(),
                 "" if alone is None else alone.shown(),
                 "" if alone is None or not alone.mean("reuse") else
                 f"{summary.mean('reuse') / alone.mean('reuse'):.2f}x placed")]
        p50, p99 = summary.staleness()
        if p50 is not None and p99 is not None:
            rows.append((f"{c.label}: staleness p50 / p99 ms (worst run)", f"{p50:.1f} / {p99:.1f}", "", ""))
        errors, unknown = sum(r.errors for r in summary.runs), sum(r.unknown_prompts for r in summary.runs)
        if errors or unknown:
            rows.append((f"{c.label}: failed requests / prompts the capture lacks", f"{errors} / {unknown}", "", ""))
        return rows

def run(quick: bool = False, model: str | None = None) -> BenchResult:
    with tempfile.TemporaryDirectory(prefix="kvrelay-bench-replicas-") as tmp:
        return Bench(quick, Path(tmp)).run()
