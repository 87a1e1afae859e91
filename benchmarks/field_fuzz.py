"""Field fuzzing through real processes: hostile request bodies (benchmarks/fuzz_bodies.py)
sent in batches to a gateway and straight to its engine, both CLI processes on loopback,
the gateway recording to SQLite. Every case goes to the gateway; a case the gateway did
not answer with 200 goes to the engine too (one it answered, the engine has already
served through it, and on the real model generation is most of a batch's time).

Schemathesis (benchmarks/fuzz.py) explores the OpenAPI schemas; this explores what the
schemas cannot express and what broke in practice: `"seed": 2**70` killed the engine
thread, a lone surrogate in a message 500ed both servers, killed the record writer and
broke /metrics. So after every batch the whole stack is checked, not just the answers:

- no server error: no 5xx, and no 200 stream that carries a server-side error event,
  ends without [DONE], or breaks off (each a server failure as a client sees it);
- every request sent to the gateway has exactly one row in `requests`: the row count
  grows by exactly the number sent, no session appears twice, and each tagged request
  that the engine answered has its row (a request refused while its body is read has no
  session yet, so the count is what covers it);
- the gateway's /ready and /metrics (which must parse as Prometheus text) and the
  engine's /health and /metrics answer 200, and a normal chat request answers with
  content, through the gateway and straight to the engine.

A batch that leaves the stack broken is replayed one case at a time on a fresh stack to
name the case that breaks it, then the stack is restarted so later batches still probe.
Tracebacks that appear in the services' logs are collected too (a caught exception can
still be a bug), as information beside the checks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sqlite3
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import aiohttp
import httpx
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.fuzz_bodies import MODEL, FuzzCase, draw_cases
from benchmarks.stack import Service, engine, gateway

SECRET = "field-fuzz-secret-" + "f" * 16
ADMIN = "field-fuzz-admin-" + "a" * 16
SESSION_HEADER = "x-kvrelay-session-id"
# Untagged cases run in an app of their own: the gateway links a request without a
# session id to the session whose earlier texts its prompt quotes, and within one app an
# untagged case could join a tagged case's session, which would read as a double record.
UNTAGGED = {"x-kvrelay-app": "ff-untagged"}
REQUEST_TIMEOUT_S = 60.0  # a request with max_tokens <= 4 that takes longer has hung
ROWS_TIMEOUT_S = 15.0  # how long the record writer may take to catch up after a batch
MAX_REPLAYS = 3  # broken batches replayed case by case to find the culprit, per run
NORMAL_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4,
               "temperature": 0, "ignore_eos": True}
SERVER_FAILURES = ("server_error", "in_band_error", "truncated", "broken", "bad_body")


class Reply(NamedTuple):
    kind: str  # ok | client_error | server_error | in_band_error | truncated | broken | bad_body | timeout
    status: int | None
    detail: str


@dataclass
class Finding:
    """One kind of failure: how often it was seen, the first case or traceback, a note."""
    count: int
    example: str
    note: str = ""
    alone: bool | None = None  # whether the example fails the same way when sent alone (None: not tried)


@dataclass
class FieldFuzzResult:
    cases: int = 0  # distinct bodies drawn, each sent to the gateway (and maybe to the engine)
    requests: int = 0
    server_errors: int = 0  # replies of the kinds in SERVER_FAILURES, both targets
    server_errors_by_target: Counter[str] = field(default_factory=Counter)
    timeouts: int = 0
    records_lost: int = 0
    records_extra: int = 0
    broken_batches: int = 0  # batches after which a check of the stack failed
    batch_seconds: list[float] = field(default_factory=list)
    failures: dict[str, Finding] = field(default_factory=dict)  # by what failed
    tracebacks: dict[str, Finding] = field(default_factory=dict)  # by what was raised where
    logs: str = ""

    @property
    def seconds_per_batch(self) -> float:
        return sum(self.batch_seconds) / max(len(self.batch_seconds), 1)

    @property
    def ok(self) -> bool:
        return not (self.server_errors or self.timeouts or self.records_lost or self.records_extra
                    or self.broken_batches)

    def note(self, key: str, example: str, into: dict[str, Finding] | None = None) -> bool:
        """Count one failure under `key`; whether it is the first of its kind."""
        findings = self.failures if into is None else into
        finding = findings.setdefault(_normalise(key), Finding(0, _printable(example)))
        finding.count += 1
        return finding.count == 1

    def summary(self) -> str:
        lines = [f"{self.cases} cases, {self.requests} requests in {len(self.batch_seconds)} batches "
                 f"({self.seconds_per_batch:.2f} s per batch): {self.server_errors} server errors "
                 f"{dict(self.server_errors_by_target)}, {self.timeouts} timeouts, "
                 f"{self.records_lost} records lost, {self.records_extra} extra, "
                 f"{self.broken_batches} batches left the stack broken; logs in {self.logs}"]
        lines += [f"{f.count}x {key}\n    e.g. {f.example}" + (f"\n    {f.note}" if f.note else "")
                  for key, f in self.failures.items()]
        lines += [f"{f.count}x traceback in a log: {key}\n{f.example}" for key, f in self.tracebacks.items()]
        return "\n".join(lines)


def _printable(text: str) -> str:
    """Text that can be printed and written as UTF-8: a lone surrogate becomes \\ud800."""
    return text.encode("utf-8", "backslashreplace").decode()


def _normalise(text: str) -> str:
    """One key for one kind of failure: ids, addresses and long numbers do not split it."""
    text = re.sub(r"[0-9a-f]{12,}", "<id>", _printable(text).replace("\n", " / "))
    text = re.sub(r"127\.0\.0\.1:\d+", "<host>", text)
    return re.sub(r"(?<![\w\\])\d{3,}", "N", text)[:240]


def classify(status: int, content_type: str, raw: bytes) -> Reply:
    """What a reply means for the server's health (not whether the request was valid)."""
    text = raw[:300].decode(errors="replace")
    if status >= 500:
        return Reply("server_error", status, text)
    if status != 200:
        return Reply("client_error", status, "")
    if not content_type.startswith("text/event-stream"):
        try:
            json.loads(raw)
        except ValueError:
            return Reply("bad_body", status, text)
        return Reply("ok", status, "")
    lines = raw.split(b"\n")
    for line in lines:
        if not line.startswith(b"data: {"):
            continue
        try:
            event = json.loads(line[6:])
        except ValueError:
            return Reply("bad_body", status, line[:300].decode(errors="replace"))
        error = event.get("error") if isinstance(event, dict) else None
        if isinstance(error, dict) and error.get("type") != "invalid_request_error":
            return Reply("in_band_error", status, line[:300].decode(errors="replace"))
    if b"data: [DONE]" not in lines:
        return Reply("truncated", status, raw[-300:].decode(errors="replace"))
    return Reply("ok", status, "")


async def send(http: aiohttp.ClientSession, url: str, case: FuzzCase, headers: dict[str, str]) -> Reply:
    try:
        async with http.post(url + case.endpoint, data=case.body,
                             headers={"content-type": "application/json", **headers}) as resp:
            raw = await resp.read()
            return classify(resp.status, resp.headers.get("content-type", ""), raw)
    except asyncio.TimeoutError:
        return Reply("timeout", None, f"no complete answer in {REQUEST_TIMEOUT_S:.0f} s")
    except aiohttp.ClientError as exc:
        return Reply("broken", None, f"{type(exc).__name__}: {exc}")


_FRAME = re.compile(r'\s*File "([^"]+)", line \d+, in (\S+)')


class LogWatch:
    """New tracebacks in a service's log since the last look."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset = path, 0

    def skip(self) -> None:
        self.offset = self.path.stat().st_size if self.path.exists() else 0

    def tracebacks(self) -> list[tuple[str, str]]:
        """(exception line, the traceback's text) for each new traceback."""
        if not self.path.exists():
            return []
        with self.path.open("rb") as log:
            log.seek(self.offset)
            data = log.read()
        self.offset += len(data)
        text = data.decode(errors="replace")
        found = []
        for block in text.split("Traceback (most recent call last):")[1:]:
            lines = block.splitlines()
            if not lines:
                continue
            # The exception line: the first one after the frames that is not indented.
            end = next((i for i, ln in enumerate(lines) if i and ln and not ln.startswith((" ", "\t"))), len(lines) - 1)
            frames = [m for ln in lines[:end] if (m := _FRAME.match(ln)) and "site-packages" not in m[1]
                      and "/lib/python3" not in m[1]]
            where = f" in {Path(frames[-1][1]).name}:{frames[-1][2]}" if frames else ""
            found.append((f"{lines[end].split(':')[0]}{where}", "\n".join(lines[max(0, end - 14):end + 1])))
        return found


class FieldFuzzer:
    """An engine and a gateway of its own, the batches, the checks and the tally."""

    def __init__(self, model: str, log_dir: Path, concurrency: int = 4) -> None:
        self.log_dir, self.concurrency = log_dir, concurrency
        self.db_path = log_dir / "field-fuzz.sqlite"
        self.engine = engine("engine-field-fuzz", model, log_dir, SECRET)
        self.gateway = gateway([self.engine.url], f"sqlite+aiosqlite:///{self.db_path}", log_dir, SECRET, ADMIN,
                               name="gateway-field-fuzz")
        self.watches = {s.name: LogWatch(s.log) for s in (self.engine, self.gateway)}
        self.result = FieldFuzzResult(logs=str(log_dir))
        self.sent_to_gateway = 0  # requests the gateway had to record since it started on this file
        self.lost_before = 0  # records lost before the last restart
        self.twice: set[str] = set()  # sessions found recorded twice (each reported once)
        self.normal_checks = 0

    # -- the run ---------------------------------------------------------------------------------
    def run(self, num_cases: int, batch_size: int, seed: int = 0) -> FieldFuzzResult:
        replays = 0
        try:
            self._start()
            for batch in range(-(-num_cases // batch_size)):
                cases = draw_cases(min(batch_size, num_cases - batch * batch_size), seed * 100_003 + batch)
                started = time.perf_counter()
                replies = asyncio.run(self._send_batch(cases, f"ff-{seed}-{batch}"))
                firsts = self._tally(cases, replies)
                problems = self._check(cases, replies, f"ff-{seed}-{batch}")
                self.result.batch_seconds.append(time.perf_counter() - started)
                if not problems:
                    self._confirm_alone(firsts, f"ff-{seed}-{batch}-alone")
                    continue
                self.result.broken_batches += 1
                for problem in problems:
                    self.result.note(f"stack check after a batch: {problem}", f"batch {batch}")
                if replays < MAX_REPLAYS:
                    replays += 1
                    self._replay(cases, f"ff-{seed}-{batch}-replay")
                self._restart()
        finally:
            self._stop()
        return self.result

    async def _send_batch(self, cases: list[FuzzCase], tag: str,
                          concurrency: int | None = None) -> list[tuple[Reply, Reply | None]]:
        """Each case to the gateway, then to the engine unless the gateway answered 200;
        (gateway reply, engine reply or None) per case."""
        replies: list[tuple[Reply, Reply | None] | None] = [None] * len(cases)
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(len(cases)):
            queue.put_nowait(i)
        self.sent_to_gateway += len(cases)
        timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            async def worker() -> None:
                while not queue.empty():
                    i = queue.get_nowait()
                    via_gateway = await send(http, self.gateway.url, cases[i], _headers(cases[i], f"{tag}-{i}"))
                    direct = None if via_gateway.status == 200 else await send(http, self.engine.url, cases[i], {})
                    replies[i] = (via_gateway, direct)

            await asyncio.gather(*(worker() for _ in range(concurrency or self.concurrency)))
        return [pair for pair in replies if pair is not None]

    def _tally(self, cases: list[FuzzCase],
               replies: list[tuple[Reply, Reply | None]]) -> list[tuple[str, str, FuzzCase]]:
        """Count the batch's replies; the failures seen for the first time (key, target, case)."""
        result, firsts = self.result, []
        result.cases += len(cases)
        for case, pair in zip(cases, replies, strict=True):
            for target, reply in zip(("gateway", "engine"), pair):
                if reply is None:
                    continue
                result.requests += 1
                if reply.kind in SERVER_FAILURES:
                    result.server_errors += 1
                    result.server_errors_by_target[target] += 1
                elif reply.kind == "timeout":
                    result.timeouts += 1
                else:
                    continue
                key = (f"{target} {case.endpoint} [{case.fields}]: {reply.kind} {reply.status or ''}: "
                       f"{reply.detail[:160]}")
                if result.note(key, case.describe()):
                    firsts.append((_normalise(key), target, case))
        return firsts

    def _confirm_alone(self, firsts: list[tuple[str, str, FuzzCase]], tag: str) -> None:
        """Send each new failure's case again, alone: in a batch, one request can fail
        others (an engine step that raises fails every request in it)."""
        async def resend() -> list[Reply]:
            timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
            async with aiohttp.ClientSession(timeout=timeout) as http:
                return [await send(http, (self.gateway if target == "gateway" else self.engine).url, case,
                                   _headers(case, f"{tag}-{i}") if target == "gateway" else {})
                        for i, (_, target, case) in enumerate(firsts)]

        self.sent_to_gateway += sum(target == "gateway" for _, target, _ in firsts)
        for (key, _, _), reply in zip(firsts, asyncio.run(resend())):
            finding = self.result.failures[key]
            finding.alone = reply.kind in SERVER_FAILURES or reply.kind == "timeout"
            finding.note = ("sent again alone: fails the same way" if finding.alone else
                            f"sent again alone: {reply.kind} {reply.status} (failed in the batch only)")

    # -- the checks ------------------------------------------------------------------------------
    def _check(self, cases: list[FuzzCase], replies: list[tuple[Reply, Reply | None]], tag: str) -> list[str]:
        """What is wrong with the stack now; empty when all is well."""
        problems = [f"{s.name} exited with {s.proc.returncode}" for s in (self.engine, self.gateway)
                    if s.proc is not None and s.proc.poll() is not None]
        # No kept-alive connections: after a 500 the server may close one just as the
        # next check reuses it, and that ReadError would be the client's, not the server's.
        with httpx.Client(timeout=REQUEST_TIMEOUT_S, limits=httpx.Limits(max_keepalive_connections=0)) as http:
            for service, path in ((self.gateway, "/ready"), (self.gateway, "/metrics"), (self.engine, "/health"),
                                  (self.engine, "/metrics")):
                problems += _get_problem(http, service, path)
            self.normal_checks += 1
            self.sent_to_gateway += 1
            problems += _normal_chat_problem(http, self.gateway, {SESSION_HEADER: f"ff-normal-{self.normal_checks}"})
            problems += _normal_chat_problem(http, self.engine, {})
        problems += self._records_problems(cases, replies, tag)
        for name, watch in self.watches.items():
            for exc_line, text in watch.tracebacks():
                self.result.note(f"{name}: {exc_line}", text, into=self.result.tracebacks)
        return problems

    def _records_problems(self, cases: list[FuzzCase], replies: list[tuple[Reply, Reply | None]],
                          tag: str) -> list[str]:
        deadline = time.monotonic() + ROWS_TIMEOUT_S
        while True:
            total, sessions = _rows(self.db_path, "ff-")
            if total >= self.sent_to_gateway or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        problems = []
        lost = self.lost_before + max(self.sent_to_gateway - total, 0)
        extra = max(total - self.sent_to_gateway, 0)
        if lost > self.result.records_lost:
            problems.append(f"{lost - self.result.records_lost} requests have no record "
                            f"({total} rows for {self.sent_to_gateway} requests)")
        twice = [s for s, n in sessions.items() if n > 1 and s not in self.twice]
        self.twice.update(twice)
        if extra > self.result.records_extra or twice:
            problems.append(f"{extra} rows too many; sessions recorded more than once: {twice[:3]}")
        self.result.records_lost, self.result.records_extra = lost, max(extra, self.result.records_extra)
        missing = [case for i, (case, (reply, _)) in enumerate(zip(cases, replies))
                   if case.tagged and reply.kind == "ok" and f"{tag}-{i}" not in sessions]
        if missing:
            problems.append(f"{len(missing)} answered requests have no record, e.g. {missing[0].describe()}")
        return problems

    # -- broken stacks ---------------------------------------------------------------------------
    def _replay(self, cases: list[FuzzCase], tag: str) -> None:
        """On a fresh stack, each case alone, checking the stack after each: the first
        case after which a check fails is named. What it finds is not tallied again."""
        self._restart()
        for i, case in enumerate(cases):
            replies = asyncio.run(self._send_batch([case], f"{tag}-{i}", concurrency=1))
            problems = self._check([case], replies, f"{tag}-{i}")
            if problems:
                self.result.note(f"breaks the stack alone: {'; '.join(problems)}", case.describe())
                return
        self.result.note("a broken batch broke nothing when replayed case by case", tag)

    def _start(self) -> None:
        """Both services, or neither: a gateway that cannot start must not leave the engine running."""
        try:
            self.engine.start()
            self.gateway.start()
            _wait_ready(self.gateway)
        except BaseException:
            self.gateway.stop()
            self.engine.stop()
            raise
        for watch in self.watches.values():
            watch.skip()  # start-up lines are not findings

    def _stop(self) -> None:
        self.gateway.stop()
        self.engine.stop()
        for name, watch in self.watches.items():  # what shutting down logged
            for exc_line, text in watch.tracebacks():
                self.result.note(f"{name}: {exc_line}", text, into=self.result.tracebacks)

    def _restart(self) -> None:
        self._stop()
        self._start()
        total, _ = _rows(self.db_path, "ff-")
        # Rows a dead writer never wrote stay lost (counted so far); count on from the rows there are.
        self.lost_before, self.sent_to_gateway = self.result.records_lost, total


def _headers(case: FuzzCase, session: str) -> dict[str, str]:
    return {SESSION_HEADER: session} if case.tagged else UNTAGGED


def _get_problem(http: httpx.Client, service: Service, path: str) -> list[str]:
    try:
        response = http.get(service.url + path)
    except httpx.HTTPError as exc:
        return [f"{service.name} {path}: {type(exc).__name__}"]
    if response.status_code != 200:
        return [f"{service.name} {path}: {response.status_code} {response.text[:200]}"]
    if path == "/metrics" and service.name.startswith("gateway"):
        try:
            list(text_string_to_metric_families(response.text))
        except ValueError as exc:
            return [f"{service.name} /metrics does not parse: {exc}"]
    return []


def _normal_chat_problem(http: httpx.Client, service: Service, headers: dict[str, str]) -> list[str]:
    try:
        response = http.post(f"{service.url}/v1/chat/completions", json=NORMAL_CHAT, headers=headers)
    except httpx.HTTPError as exc:
        return [f"a normal chat request to {service.name}: {type(exc).__name__}"]
    if response.status_code != 200:
        return [f"a normal chat request to {service.name}: {response.status_code} {response.text[:200]}"]
    try:
        content = response.json()["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError):
        return [f"a normal chat request to {service.name}: not a chat completion: {response.text[:200]}"]
    return [] if isinstance(content, str) and content else [f"a normal chat request to {service.name}: no content"]


def _rows(db_path: Path, prefix: str) -> tuple[int, dict[str, int]]:
    """All request rows, and the rows of each session named `prefix`*."""
    with sqlite3.connect(db_path) as conn:
        total = conn.execute("SELECT count(*) FROM requests").fetchone()[0]
        sessions = dict(conn.execute("SELECT session_id, count(*) FROM requests WHERE session_id LIKE ? "
                                     "GROUP BY session_id", (f"{prefix}%",)).fetchall())
    return total, sessions


def _wait_ready(gw: Service, timeout: float = 30.0) -> None:
    """Until the gateway has seen its engine healthy (its /health answers before that)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            ready = httpx.get(f"{gw.url}/ready", timeout=5).status_code == 200
        except httpx.HTTPError:
            ready = False  # not listening yet, or busy: ask again until the deadline
        if ready:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{gw.name} not ready after {timeout:.0f} s")
        time.sleep(0.2)


def run_field_fuzz(model: str, log_dir: Path, num_cases: int, batch_size: int = 100, seed: int = 0,
                   concurrency: int = 4) -> FieldFuzzResult:
    log_dir.mkdir(parents=True, exist_ok=True)
    return FieldFuzzer(model, log_dir, concurrency).run(num_cases, batch_size, seed)


def main() -> None:
    """`python -m benchmarks.field_fuzz [--cases N] [--model DIR]`: a run on its own."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--model", help="model directory (default: the default model)")
    parser.add_argument("--log-dir", type=Path, help="where the services' logs and the SQLite file go")
    args = parser.parse_args()
    if args.model is None:
        from engine_ext.model_store import prepare_default_model

        args.model = str(prepare_default_model(progress=False))
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="kvrelay-field-fuzz-"))
    result = run_field_fuzz(args.model, log_dir, args.cases, args.batch, args.seed, args.concurrency)
    print(result.summary())
    raise SystemExit(0 if result.ok else 1)


if __name__ == "__main__":
    main()
