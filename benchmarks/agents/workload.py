"""Captured agent-framework traffic as replayable workloads.

A capture (tests/data/agents/<app>.jsonl, written by the capture scripts next to it) is
what a real framework sent, request by request, with ground truth recorded on the way:
which app, run and agent sent each request, and where each prompt quotes an earlier
answer, the run's task or a tool result. A replay must keep that structure real while
the answers change: every quoted answer is replaced by the answer this replay got for
the request that produced it (`render`), so a prompt reads what its app would really
have shown the model, and the quotes' offsets move with it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

CAPTURES = Path(__file__).resolve().parents[2] / "tests" / "data" / "agents"
QuoteKind = Literal["output", "question", "tool_result"]


@dataclass(frozen=True)
class Quote:
    """A span of one message's text (or of one text part of it) that reproduces an earlier text."""

    message: int
    part: int | None
    start: int
    end: int
    kind: QuoteKind
    sources: tuple[int, ...]  # seq of the request(s) whose answer it is (tool results: the calling request)
    form: Literal["exact", "strip"]


@dataclass(frozen=True)
class Request:
    workload: str
    seq: int
    run: str
    agent: str
    round: str | None
    t_start: float
    t_end: float
    path: str
    headers: dict[str, str]
    body: dict[str, Any]
    dropped: tuple[str, ...]  # fields the recording engine refused, removed before any replay
    response: dict[str, Any]
    quotes: tuple[Quote, ...]

    @property
    def key(self) -> tuple[str, int]:
        return self.workload, self.seq

    @property
    def scripted(self) -> bool:
        """The recorder answered it with scripted tool calls (a small model emits none)."""
        return bool(self.response.get("scripted"))


@dataclass(frozen=True)
class Run:
    """One execution of an app: a session, as its user would call it."""

    workload: str
    name: str
    task: str
    concurrent_group: str | None
    requests: tuple[Request, ...]  # in order of arrival

    @property
    def key(self) -> tuple[str, str]:
        return self.workload, self.name

    def waits_for(self, request: Request) -> list[Request]:
        """The run's requests that had ended when `request` was sent: a replay sends it only
        after they have ended again, so the app's own concurrency (a round's agents sent
        at once) is kept and its order is never inverted."""
        return [r for r in self.requests if r.t_end <= request.t_start and r.seq != request.seq]


@dataclass(frozen=True)
class Workload:
    name: str
    framework: str
    description: str
    runs: tuple[Run, ...]

    @property
    def requests(self) -> list[Request]:
        return sorted((r for run in self.runs for r in run.requests), key=lambda r: r.seq)


def load(path: Path) -> Workload:
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    header, records = lines[0], lines[1:]
    name = header["workload"]
    requests = [_request(name, record) for record in records]
    runs = tuple(Run(name, run, meta["task"], meta.get("concurrent_group"),
                     tuple(r for r in requests if r.run == run))
                 for run, meta in header["runs"].items())
    return Workload(name, header["framework"], header["description"], tuple(r for r in runs if r.requests))


def load_all(directory: Path = CAPTURES, names: list[str] | None = None) -> list[Workload]:
    paths = sorted(directory.glob("*.jsonl"))
    workloads = [load(p) for p in paths if names is None or p.stem in names]
    if names is not None and len(workloads) != len(names):
        missing = set(names) - {w.name for w in workloads}
        raise FileNotFoundError(f"no capture for {sorted(missing)} in {directory}")
    return workloads


def _request(workload: str, record: dict[str, Any]) -> Request:
    quotes = tuple(Quote(q["message"], q.get("part"), q["start"], q["end"], q["kind"], tuple(q.get("sources", ())),
                         q.get("form", "exact")) for q in record.get("quotes", ()))
    return Request(workload, record["seq"], record["run"], record["agent"], record.get("round"), record["t_start"],
                   record["t_end"], record.get("path", "/v1/chat/completions"), dict(record.get("headers", {})),
                   record["body"], tuple(record.get("dropped", ())), record["response"], quotes)


def render(request: Request, answers: Mapping[tuple[str, int], str]) -> tuple[dict[str, Any], list[Quote]]:
    """The request's body with every quoted answer replaced by this replay's answer of
    its source (`answers`, keyed by Request.key; a source missing there keeps its
    recorded text), and the quotes at their new offsets. Fields the recording engine
    refused are dropped, as they were for the capture's own answers."""
    body = {k: v for k, v in request.body.items() if k not in request.dropped}
    messages = [dict(m) for m in body.get("messages", [])]
    moved: list[Quote] = []
    by_text: dict[tuple[int, int | None], list[Quote]] = {}
    for quote in request.quotes:
        by_text.setdefault((quote.message, quote.part), []).append(quote)
    for (index, part), quotes in by_text.items():
        message = messages[index]
        if part is None:
            message["content"], placed = _substitute(message["content"], quotes, answers, request.workload)
        else:
            parts = [dict(p) for p in message["content"]]
            parts[part]["text"], placed = _substitute(parts[part]["text"], quotes, answers, request.workload)
            message["content"] = parts
        moved += placed
    if messages:
        body["messages"] = messages
    return body, sorted(moved, key=lambda q: (q.message, q.part or 0, q.start))


def _substitute(text: str, quotes: list[Quote], answers: Mapping[tuple[str, int], str],
                workload: str) -> tuple[str, list[Quote]]:
    """Replace the answer quotes of one text, left to right, tracking the shift."""
    pieces: list[str] = []
    placed: list[Quote] = []
    cursor = shift = 0
    for quote in sorted(quotes, key=lambda q: q.start):
        replacement = text[quote.start:quote.end]
        if quote.kind == "output" and quote.sources:
            live = answers.get((workload, quote.sources[0]))
            if live is not None:
                replacement = live.strip() if quote.form == "strip" else live
        pieces += [text[cursor:quote.start], replacement]
        start = quote.start + shift
        placed.append(Quote(quote.message, quote.part, start, start + len(replacement), quote.kind, quote.sources,
                            quote.form))
        shift += len(replacement) - (quote.end - quote.start)
        cursor = quote.end
    pieces.append(text[cursor:])
    return "".join(pieces), placed
