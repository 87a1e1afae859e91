"""benchmarks/report.py: the committed doc matches docs/results, bad results fail in one line, tables group."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks import report

ROOT = Path(__file__).resolve().parents[2]


DOC = "# Bench\n\nprose\n\n<!-- results:begin -->\nstale\n<!-- results:end -->\n\nafter\n"
MACHINE = {"cpu_count": 2, "torch": "2.13.0+cpu", "python": "3.11.7"}


def _write(folder: Path, name: str, payload: Any) -> Path:
    folder.mkdir(exist_ok=True)
    path = folder / f"{name}.json"
    path.write_text(payload if isinstance(payload, str) else json.dumps(payload))
    return path


def test_committed_doc_is_up_to_date_with_docs_results() -> None:
    assert list((ROOT / "docs" / "results").glob("*.json")), "docs/results has no results"
    done = subprocess.run([sys.executable, "-m", "benchmarks.report", "--check"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "up to date" in done.stdout


def test_check_reports_an_out_of_date_doc_without_writing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _write(tmp_path / "results", "tiny", {"name": "tiny", "metrics": {"x": 1}, "config": {}, "machine": MACHINE})
    doc = tmp_path / "bench.md"
    doc.write_text(DOC)

    assert report.main(["--results", str(tmp_path / "results"), "--doc", str(doc), "--check"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "out of date" in err and doc.read_text() == DOC

    assert report.main(["--results", str(tmp_path / "results"), "--doc", str(doc)]) == 0
    assert report.main(["--results", str(tmp_path / "results"), "--doc", str(doc), "--check"]) == 0
    text = doc.read_text()
    assert text.startswith("# Bench\n\nprose\n\n<!-- results:begin -->\n") and text.endswith("<!-- results:end -->\n\nafter\n")
    assert "stale" not in text and "### tiny" in text and "| x | 1 |" in text


GOOD: dict[str, Any] = {"name": "good", "metrics": {"a": 1.5}, "config": {"quick": False}, "machine": MACHINE}


@pytest.mark.parametrize(
    ("payload", "says"),
    [
        ("{not json", "not valid JSON"),
        ([1, 2], "not an object"),
        ({**GOOD, "name": ""}, "name"),
        ({**GOOD, "metrics": {"a": "fast"}}, "metrics['a']"),
        ({**GOOD, "metrics": {"a": True}}, "metrics['a']"),
        ('{"name": "bad", "metrics": {"a": NaN}, "config": {}, "machine": {}}', "metrics['a']"),
        ({**GOOD, "metrics": [1.0]}, "metrics"),
        ({key: value for key, value in GOOD.items() if key != "machine"}, "machine"),
        ({**GOOD, "config": "quick"}, "config"),
    ],
)
def test_a_malformed_results_file_is_a_one_line_error_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], payload: Any, says: str
) -> None:
    _write(tmp_path / "results", "a_good", GOOD)
    bad = _write(tmp_path / "results", "bad", payload)
    doc = tmp_path / "bench.md"
    doc.write_text(DOC)

    assert report.main(["--results", str(tmp_path / "results"), "--doc", str(doc)]) == 2

    out = capsys.readouterr()
    assert out.err.count("\n") == 1 and str(bad) in out.err and says in out.err, out.err
    assert out.out == "" and doc.read_text() == DOC


def test_a_doc_without_the_markers_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _write(tmp_path / "results", "good", GOOD)
    doc = tmp_path / "bench.md"
    doc.write_text("# Bench\n\n<!-- results:begin -->\n")

    assert report.main(["--results", str(tmp_path / "results"), "--doc", str(doc), "--check"]) == 2
    assert str(doc) in capsys.readouterr().err


def _tables(text: str) -> list[list[str]]:
    """The Markdown tables in text, each as its lines."""
    return [block.splitlines() for block in text.split("\n\n") if block.startswith("|")]


def test_rendering_groups_names_into_rows_and_columns(tmp_path: Path) -> None:
    metrics: dict[str, float] = {
        # workload x measure x stack: one table per measure, workloads down, stacks across
        **{f"{w}_{m}_{s}": v for (w, m, s), v in zip(
            [(w, m, s) for w in ("wa", "wb", "wc") for m in ("hits", "ttft_ms") for s in ("fast", "slow")],
            [1, 0.5, 2, 3, 4, 1234.5678, 6, 7, 8, 9, 10, 0.000123456],
        )},
        # a number suffix: rows by the rest, numbers across in numeric order
        "round_ms_group_3": 1.5, "round_ms_group_10": 2.0, "round_ms_alone_10": 3.25, "speedup_5": 1.0,
        "kl": 0.25,
    }
    result = report.Result(tmp_path / "results" / "x.json", "x", metrics, {"quick": True}, MACHINE)

    text = report.render([result], tmp_path)

    assert text.startswith("\n### x\n\nMachine: 2 CPUs, torch 2.13.0+cpu, Python 3.11.7; quick run (`--quick`); "
                           "17 metrics from [`results/x.json`](results/x.json).\n\n")
    assert _tables(text) == [
        ["| metric | 3 | 5 | 10 |", "|---|---:|---:|---:|",
         "| round_ms_alone |  |  | 3.25 |", "| round_ms_group | 1.5 |  | 2 |", "| speedup |  | 1 |  |"],
        ["| hits | fast | slow |", "|---|---:|---:|", "| wa | 1 | 0.5 |", "| wb | 4 | 1235 |", "| wc | 8 | 9 |"],
        ["| ttft_ms | fast | slow |", "|---|---:|---:|", "| wa | 2 | 3 |", "| wb | 6 | 7 |", "| wc | 10 | 0.0001235 |"],
        ["| metric | value |", "|---|---:|", "| kl | 0.25 |"],
    ]
    assert report.render([result], tmp_path) == text  # deterministic
