"""The CLI turns bad input into one line on stderr and exit code 2."""

from __future__ import annotations

import subprocess
import sys

import pytest


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    code = "import sys; from kvrelay.cli import main; sys.argv = ['kvrelay', *sys.argv[1:]]; main()"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("engine", "--model", "/nonexistent/model"), "not a directory with config.json"),
        (("engine", "--port", "0"), "--port"),
        (("engine", "--bogus"), "No such option"),
        (("bench", "nope"), "unknown benchmark 'nope'"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, message):
    proc = run_cli(*args)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("kvrelay: error: ") and message in lines[0]


def test_engine_refuses_a_model_it_cannot_serve(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "vocab_size": 10}')
    proc = run_cli("engine", "--model", str(tmp_path))
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("kvrelay: error: ")


def test_help_lists_the_commands():
    proc = run_cli("--help")
    assert proc.returncode == 0
    for command in ("engine", "bench", "prepare-model"):
        assert command in proc.stdout
