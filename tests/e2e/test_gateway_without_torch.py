"""The gateway installs and runs without the engine's stack.

`kvrelay gateway` runs in a child process where torch, the rest of the `engine` extra
and the engine's own package cannot be imported: every import of them raises, as in a
venv holding only `pip install kvrelay`. It proxies a streamed chat completion to a
fake upstream and keeps the request's record, so nothing on that path needs the engine.
"""

from __future__ import annotations

import json
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

# The `engine` extra of pyproject.toml, and the engine's package: a gateway-only install has none of them.
ENGINE_ONLY = ("torch", "safetensors", "tokenizers", "llguidance", "gguf", "transformers", "accelerate", "triton",
               "engine_ext")

BLOCKER = f"""
import importlib.abc, sys
class EngineOnly(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {ENGINE_ONLY!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (a gateway-only install)")
        return None
sys.meta_path.insert(0, EngineOnly())
from kvrelay.cli import main
sys.argv = ["kvrelay", *sys.argv[1:]]
main()
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{url} exited with {proc.returncode}: {proc.stderr.read().decode() if proc.stderr else ''}")
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{url} did not come up")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture
def upstream() -> Iterator[str]:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.fake_upstream", "--port", str(port), "--chunks", "3"],
                            stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc)
        yield url
    finally:
        _stop(proc)


def test_the_gateway_serves_and_records_without_the_engine_stack(upstream: str, tmp_path: Path) -> None:
    port = _free_port()
    database = tmp_path / "gateway.sqlite"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-c", BLOCKER, "gateway", "--upstream", upstream, "--port", str(port),
                             "--database-url", f"sqlite+aiosqlite:///{database}"],
                            stderr=subprocess.PIPE, env=env, cwd=Path(__file__).resolve().parents[2])
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc)
        body = {"model": "fake", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as response:
            assert response.status_code == 200
            events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
            request_id = response.headers["x-kvrelay-request-id"]
        assert events[-1] == "[DONE]"
        text = "".join((json.loads(e)["choices"] or [{}])[0].get("delta", {}).get("content") or ""
                       for e in events[:-1])
        assert text == " w0 w1 w2"
        deadline = time.monotonic() + 10
        while _status(database, request_id) is None and time.monotonic() < deadline:
            time.sleep(0.1)  # the record is written in the background, soon after the stream ends
        assert _status(database, request_id) == ("ok", 200)
    finally:
        _stop(proc)
    assert proc.returncode == 0 or proc.returncode == -15, proc.stderr.read().decode() if proc.stderr else ""


def _status(database: Path, request_id: str) -> tuple[str, int] | None:
    with sqlite3.connect(database) as db:
        row = db.execute("SELECT status, http_status FROM requests WHERE id = ?", (request_id,)).fetchone()
    return None if row is None else (str(row[0]), int(row[1]))


def test_the_blocker_really_blocks() -> None:
    """The child process above would prove nothing if the blocker let torch through."""
    code = BLOCKER.replace("from kvrelay.cli import main\nsys.argv = [\"kvrelay\", *sys.argv[1:]]\nmain()\n",
                           "import torch\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "a gateway-only install" in proc.stderr


def test_the_engine_command_names_the_extra_it_needs() -> None:
    proc = subprocess.run([sys.executable, "-c", BLOCKER, "engine"], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "the `engine` extra" in lines[0], proc.stderr
