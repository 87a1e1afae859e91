"""Benchmark tables in docs/benchmarks.md, generated from the benches' JSON results.

Why: numbers copied into docs by hand drift from the runs that produced them. The JSON
`kvrelay bench NAME --json docs/results/NAME.json` writes is the record; this renders it
between `<!-- results:begin -->` and `<!-- results:end -->`, and `--check` (run by the
tests) exits 1 when the doc is out of date. A malformed results file or doc: one line
naming it, exit 2. `python -m benchmarks.report [--results DIR] [--doc PATH] [--check]`.

Tables come from the metric names alone, so a new bench needs no code here:
1. a name whose last or second-to-last word holds a number (`_10`, `_c8_half`, `_p99_ms`)
   is row x column (`round_ms_collective` x `10`), one table per kind of number word;
2. of the other names, the set of suffixes repeating after the most prefixes (stacks:
   `_kvrelay`, `_prefix`, `_vllm_apc`) becomes a table's columns, while one saves labels;
3. a table's row names split once more the same way, one table per repeated suffix
   (`ttft_p50_ms`: workloads x stacks), the rest staying together;
4. what is left is a metric | value table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
MAX_COLS = 8  # wider tables do not read in a doc
MAX_COL_WORDS = 3  # a column key is at most this many `_`-separated words
Grid = dict[str, dict[str, str]]  # row key -> column key -> metric name


class ReportError(Exception):
    """A results file or the doc that cannot be rendered (exit 2)."""


@dataclass(frozen=True)
class Result:
    path: Path
    name: str
    metrics: dict[str, float]
    config: dict[str, Any]
    machine: dict[str, Any]


def _finite(value: object) -> bool:
    try:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    except OverflowError:  # an integer past float's range
        return False


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except (OSError, ValueError) as exc:  # ValueError: not UTF-8
        raise ReportError(f"{path}: cannot read ({exc})") from None


def load(path: Path) -> Result:
    """One results file, its shape checked: name, metrics of finite numbers, config, machine."""
    try:
        data = json.loads(_read(path))
    except (ValueError, RecursionError) as exc:
        raise ReportError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ReportError(f"{path}: not an object with name, metrics, config, machine")
    if not isinstance(data.get("name"), str) or not data["name"]:
        raise ReportError(f"{path}: name is missing or not a non-empty string")
    metrics = data.get("metrics")
    if not isinstance(metrics, dict) or not metrics:
        raise ReportError(f"{path}: metrics is missing or not a non-empty object")
    for key, value in metrics.items():
        if not _finite(value):
            raise ReportError(f"{path}: metrics[{key!r}] is {value!r}, not a finite number")
    for field in ("config", "machine"):
        if not isinstance(data.get(field), dict):
            raise ReportError(f"{path}: {field} is missing or not an object")
    return Result(path, data["name"], {k: float(v) for k, v in metrics.items()}, data["config"], data["machine"])


def natural(text: str) -> tuple[tuple[int, str], ...]:
    """Sort key with numbers compared as numbers: c8 before c32, 5 before 10."""
    return tuple((int(part), part) if part.isdigit() else (0, part) for part in re.split(r"(\d+)", text))


def fmt(value: float) -> str:
    """Integers as integers; floats to 4 significant digits, or to the unit from 1000 up."""
    value = float(value)
    if value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.4g}"


def number_grids(names: Iterable[str]) -> list[Grid]:
    """Rule 1: names ending in a number-bearing word, one grid per kind of that word."""
    by_kind: dict[str, Grid] = defaultdict(lambda: defaultdict(dict))
    for name in names:
        words = name.split("_")
        for k in (1, 2):
            if len(words) > k and re.search(r"\d", words[-k]):
                column = "_".join(words[-k:])
                by_kind[re.sub(r"\d+", "#", words[-k])]["_".join(words[:-k])][column] = name
                break
    return [grid for _, grid in sorted(by_kind.items()) if len({c for row in grid.values() for c in row}) >= 2]


def _candidates(names: Iterable[str]) -> Iterator[tuple[int, tuple[str, ...], Grid]]:
    """Each row's set of columns (2 to MAX_COLS of them), with the labels it saves and its grid.

    Each name is tried as row + "_" + column, columns of up to MAX_COL_WORDS words. A
    candidate covers the names of every row that two or more of its columns complete (one
    cell saves no label, and is as likely a coincidence). Saving = names covered - rows -
    columns: the labels a metric | value table prints and this one does not.
    """
    by_row: Grid = defaultdict(dict)
    for name in sorted(names):
        words = name.split("_")
        for k in range(1, min(MAX_COL_WORDS, len(words) - 1) + 1):
            by_row["_".join(words[:-k])]["_".join(words[-k:])] = name
    for columns in sorted({tuple(sorted(row)) for row in by_row.values() if 2 <= len(row) <= MAX_COLS}):
        grid: Grid = {}
        used: set[str] = set()
        for row in sorted(by_row):
            cells = {c: n for c, n in by_row[row].items() if c in columns and n not in used}
            if len(cells) >= 2:
                grid[row] = cells
                used.update(cells.values())
        yield sum(map(len, grid.values())) - len(grid) - len(columns), columns, grid


def best_split(names: Iterable[str]) -> Grid | None:
    """Rule 2: the grid that saves the most labels (ties: fewer columns), or None.

    Columns that are two dimensions folded into one (`hits_fast`, `hits_slow`, `ttft_fast`,
    `ttft_slow`) are passed over, so the table's rows carry the second dimension instead.
    """
    best: tuple[tuple[int, int], Grid] | None = None
    for saving, columns, grid in _candidates(names):
        score = (saving, -len(columns))
        if saving > 0 and (best is None or score > best[0]):
            if not any(len(folded) >= 2 for _, _, folded in _candidates(columns)):
                best = score, grid
    return None if best is None else best[1]


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def table(corner: str, grid: Grid, metrics: dict[str, float]) -> list[str]:
    """A Markdown table; transposed when that keeps it under MAX_COLS columns."""
    rows = sorted(grid, key=natural)
    columns = sorted({c for row in grid.values() for c in row}, key=natural)
    values = {(r, c): fmt(metrics[name]) for r in rows for c, name in grid[r].items()}
    if len(columns) > MAX_COLS and len(rows) < len(columns):
        rows, columns, values = columns, rows, {(c, r): v for (r, c), v in values.items()}
    out = ["| " + " | ".join(_cell(t) for t in [corner, *columns]) + " |", "|---|" + "---:|" * len(columns)]
    out += ["| " + " | ".join([_cell(r), *(values.get((r, c), "") for c in columns)]) + " |" for r in rows]
    return [*out, ""]


def grid_tables(grid: Grid, metrics: dict[str, float]) -> list[str]:
    """Rule 3: one table per suffix that repeats across the grid's row names, then the rest."""
    out: list[str] = []
    sub = best_split(grid) or {}
    by_suffix: dict[str, Grid] = defaultdict(dict)
    for prefix, suffixes in sub.items():
        for suffix, row in suffixes.items():
            by_suffix[suffix][prefix] = grid[row]
    for suffix in sorted(by_suffix, key=natural):
        out += table(suffix, by_suffix[suffix], metrics)
    covered = {row for suffixes in sub.values() for row in suffixes.values()}
    rest = {row: cells for row, cells in grid.items() if row not in covered}
    return out + (table("metric", rest, metrics) if rest else [])


def render_result(result: Result, doc_dir: Path) -> list[str]:
    machine, quick = result.machine, result.config.get("quick")
    run = "quick run (`--quick`)" if quick is True else "full run" if quick is False else "run kind not recorded"
    link = Path(os.path.relpath(result.path, doc_dir)).as_posix()
    out = [f"### {result.name}", "", (
        f"Machine: {machine.get('cpu_count', '?')} CPUs, torch {machine.get('torch', '?')}, "
        f"Python {machine.get('python', '?')}; {run}; {len(result.metrics)} metrics from [`{link}`]({link})."), ""]
    grids = number_grids(result.metrics)
    rest = set(result.metrics) - {name for grid in grids for row in grid.values() for name in row.values()}
    while (found := best_split(rest)) is not None:
        grids.append(found)
        rest -= {name for row in found.values() for name in row.values()}
    for grid in grids:
        out += grid_tables(grid, result.metrics)
    return out + (table("metric", {name: {"value": name} for name in rest}, result.metrics) if rest else [])


def render(results: list[Result], doc_dir: Path) -> str:
    """The text between the markers: a blank line, each bench's section, sorted by name."""
    lines = [""]
    for result in sorted(results, key=lambda r: (r.name, r.path.name)):
        lines += render_result(result, doc_dir)
    return "\n".join(lines if results else ["", "No results yet.", ""]) + "\n"


def splice(doc: str, doc_path: Path, section: str) -> str:
    lines = doc.splitlines(keepends=True)
    begins = [i for i, line in enumerate(lines) if line.strip() == BEGIN]
    ends = [i for i, line in enumerate(lines) if line.strip() == END]
    if len(begins) != 1 or len(ends) != 1 or begins[0] > ends[0]:
        raise ReportError(f"{doc_path}: needs exactly one {BEGIN} line before one {END} line")
    return "".join(lines[: begins[0] + 1]) + section + "".join(lines[ends[0]:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.report", description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=ROOT / "docs" / "results", help="folder of *.json results")
    parser.add_argument("--doc", type=Path, default=ROOT / "docs" / "benchmarks.md", help="the doc to fill")
    parser.add_argument("--check", action="store_true", help="exit 1 if the doc is out of date; write nothing")
    args = parser.parse_args(argv)
    try:
        if not args.results.is_dir():
            raise ReportError(f"{args.results}: not a directory")
        results = [load(path) for path in sorted(args.results.glob("*.json"))]
        doc = _read(args.doc)
        new = splice(doc, args.doc, render(results, args.doc.parent))
    except ReportError as exc:
        print(f"benchmarks.report: error: {exc}", file=sys.stderr)
        return 2
    if new != doc:
        if args.check:
            print(f"{args.doc} is out of date with {args.results}: run python -m benchmarks.report", file=sys.stderr)
            return 1
        args.doc.write_text(new)
    print(f"{args.doc}: {'updated' if new != doc else 'up to date'} ({len(results)} results)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
