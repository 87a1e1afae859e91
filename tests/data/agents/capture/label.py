"""Ground-truth quote labels for the agent captures, computed from the capture alone.

For every request, each place where its messages' text repeats something the run has
already produced is a quote: an earlier model answer of the same run (`output`), the
run's task text (`question`), or a tool result (`tool_result`, the role-tool message
that carries it included). The rules (README.md, "Labels") are deliberately simple
string matching, so a reader can check every label by hand; nothing here uses the
gateway's code, which is what the labels are there to judge.

    python tests/data/agents/capture/label.py tests/data/agents/*.jsonl   # rewrite quotes
    python tests/data/agents/capture/label.py --check tests/data/agents/*.jsonl tests/data/agents/long/*.jsonl

Standard library only; deterministic (the same capture gives the same labels).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SHORT_CHARS = 16  # a text shorter than this is a quote only as a whole message (or part)
# When one span is matched by several kinds, the text's origin wins: a task or a tool
# result existed before any answer that equals it, so that answer copied it.
KIND_PRIORITY = {"question": 0, "tool_result": 1, "output": 2}


@dataclass(frozen=True)
class Source:
    """A text a request may quote, and where it came from."""
    text: str
    kind: str
    sources: tuple[int, ...]


@dataclass(frozen=True)
class Span:
    start: int
    end: int
    kind: str
    sources: tuple[int, ...]
    form: str


@dataclass
class Notes:
    """What the rules decided that a reader should know about, per capture."""
    kinds: Counter[str] = field(default_factory=Counter)
    forms: Counter[str] = field(default_factory=Counter)
    same_span_other_kind: list[str] = field(default_factory=list)  # one span, several kinds: priority decided
    overlaps_dropped: int = 0  # spans that lost to a longer (or earlier) overlapping one
    unresolved_tool_ids: list[str] = field(default_factory=list)  # tool messages no recorded answer called

    def summary(self) -> dict[str, Any]:
        return {"quotes": dict(sorted(self.kinds.items())), "forms": dict(sorted(self.forms.items())),
                "same_span_other_kind": len(self.same_span_other_kind), "overlaps_dropped": self.overlaps_dropped,
                "unresolved_tool_ids": len(self.unresolved_tool_ids)}


def message_texts(message: dict[str, Any]) -> Iterator[tuple[int | None, str]]:
    """(part index or None, text) for each text a message carries."""
    content = message.get("content")
    if isinstance(content, str):
        yield None, content
    elif isinstance(content, list):
        for index, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                yield index, part["text"]


def occurrences(text: str, needle: str) -> Iterator[int]:
    """Start offsets of non-overlapping occurrences, left to right."""
    start = text.find(needle)
    while start >= 0:
        yield start
        start = text.find(needle, start + len(needle))


def find_spans(text: str, source: Source) -> list[Span]:
    """Where `source` occurs in `text`: verbatim, else in its .strip() form; a form
    shorter than SHORT_CHARS only when it is the whole text (a short answer such as "214"
    or a role name is found everywhere by chance otherwise)."""
    forms = [("exact", source.text)]
    stripped = source.text.strip()
    if stripped != source.text:
        forms.append(("strip", stripped))
    for form, needle in forms:
        if not needle:
            continue
        if len(needle) < SHORT_CHARS:
            starts = [0] if text == needle else []
        else:
            starts = list(occurrences(text, needle))
        if starts:
            return [Span(s, s + len(needle), source.kind, source.sources, form) for s in starts]
    return []


def resolve(spans: list[Span], notes: Notes, where: str) -> list[Span]:
    """Non-overlapping spans: the longest first, then the earliest; the same span found
    as several kinds keeps the kind of highest priority (KIND_PRIORITY)."""
    order = sorted(spans, key=lambda s: (-(s.end - s.start), s.start, KIND_PRIORITY[s.kind], s.sources))
    kept: list[Span] = []
    for span in order:
        clash = next((k for k in kept if span.start < k.end and k.start < span.end), None)
        if clash is None:
            kept.append(span)
        elif (clash.start, clash.end) == (span.start, span.end) and clash.kind != span.kind:
            notes.same_span_other_kind.append(f"{where}[{span.start}:{span.end}] {clash.kind} over {span.kind}")
        elif (clash.start, clash.end) != (span.start, span.end):
            notes.overlaps_dropped += 1
    return sorted(kept, key=lambda s: s.start)


def _grouped(texts: list[tuple[str, int]], kind: str) -> list[Source]:
    """One source per distinct text, with every seq that produced it (ascending)."""
    seqs: dict[str, list[int]] = {}
    for text, seq in texts:
        seqs.setdefault(text, []).append(seq)
    return [Source(text, kind, tuple(sorted(set(s)))) for text, s in seqs.items()]


def tool_text(message: dict[str, Any]) -> str:
    return "".join(text for _, text in message_texts(message))


def label_capture(header: dict[str, Any], records: list[dict[str, Any]]) -> tuple[list[list[dict[str, Any]]], Notes]:
    """The quotes of every record (in the records' order), and the notes."""
    notes = Notes()
    by_seq = sorted(records, key=lambda r: r["seq"])
    call_owner: dict[tuple[str, str], int] = {}  # (run, tool call id) -> seq whose answer made the call
    for record in by_seq:
        for call in record["response"].get("tool_calls") or []:
            call_owner.setdefault((record["run"], call["id"]), record["seq"])
    tool_results: dict[str, list[tuple[str, int]]] = {}  # run -> (text, seq of the call), as carried so far
    seen_tool_ids: dict[str, set[str]] = {}
    quotes: dict[int, list[dict[str, Any]]] = {}
    for record in by_seq:
        run = record["run"]
        messages = record["body"].get("messages") or []
        for message in messages:
            call_id = message.get("tool_call_id")
            if message.get("role") != "tool" or not isinstance(call_id, str):
                continue
            if call_id in seen_tool_ids.setdefault(run, set()):
                continue
            seen_tool_ids[run].add(call_id)
            owner = call_owner.get((run, call_id))
            if owner is None or owner >= record["seq"]:
                notes.unresolved_tool_ids.append(f"seq {record['seq']}: {call_id}")
                continue
            tool_results.setdefault(run, []).append((tool_text(message), owner))
        earlier = [(r["response"]["content"], r["seq"]) for r in by_seq
                   if r["run"] == run and r["seq"] < record["seq"] and r["t_end"] <= record["t_start"]
                   and isinstance(r["response"].get("content"), str)]
        sources = [*_grouped(earlier, "output"), *_grouped(tool_results.get(run, []), "tool_result"),
                   Source(header["runs"][run]["task"], "question", ())]
        found: list[dict[str, Any]] = []
        for m_index, message in enumerate(messages):
            for part, text in message_texts(message):
                spans = [span for source in sources for span in find_spans(text, source)]
                where = f"seq {record['seq']} message {m_index}" + ("" if part is None else f" part {part}")
                for span in resolve(spans, notes, where):
                    notes.kinds[span.kind] += 1
                    notes.forms[span.form] += 1
                    found.append({"message": m_index, "part": part, "start": span.start, "end": span.end,
                                  "kind": span.kind, "sources": list(span.sources), "form": span.form})
        quotes[record["seq"]] = found
    return [quotes[r["seq"]] for r in records], notes


def read_capture(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return lines[0], lines[1:]


def write_capture(path: Path, header: dict[str, Any], records: list[dict[str, Any]]) -> None:
    with path.open("w", encoding="utf-8") as out:
        for obj in [header, *records]:
            out.write(json.dumps(obj, ensure_ascii=False) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--check", action="store_true", help="fail if a file's quotes differ instead of rewriting")
    args = parser.parse_args()
    failed = False
    for path in args.files:
        header, records = read_capture(path)
        quotes, notes = label_capture(header, records)
        changed = [r["seq"] for r, q in zip(records, quotes, strict=True) if r.get("quotes") != q]
        if args.check:
            failed |= bool(changed)
            status = f"{len(changed)} request(s) differ" if changed else "ok"
        else:
            for record, q in zip(records, quotes, strict=True):
                record["quotes"] = q
            write_capture(path, header, records)
            status = "labelled"
        print(f"{path.name}: {status} {json.dumps(notes.summary())}")
        for note in notes.same_span_other_kind + notes.unresolved_tool_ids:
            print(f"  {note}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
