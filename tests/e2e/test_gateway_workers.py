"""`kvrelay gateway --workers N`: worker processes on one port plan as one gateway (they
share what they infer), and a database they cannot share is refused in one line."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import httpx
import pytest

from tests.gateway.support import Behaviour, FakeUpstream
from tests.helpers import answers, wait_until



KVRELAY = [sys.executable, "-c", "import sys; from kvrelay.cli import main; sys.argv = ['kvrelay', *sys.argv[1:]]; main()"]


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("KVRELAY_", "OTEL_"))}


@pytest.mark.slow
def test_workers_on_one_port_plan_as_one_gateway(tmp_path):
    fake = FakeUpstream(Behaviour())
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([*KVRELAY, "gateway", "--workers", "2", "--port", str(port),
                             "--upstream", fake.url, "--database-url", f"sqlite+aiosqlite:///{tmp_path}/gw.db",
                             "--log-level", "warning"], env=_env())
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_until(lambda: answers(f"{url}/ready"), timeout=60, interval=0.2)
        replicas, found = set(), 0
        for i in range(12):
            answer = f"Plan {i}: ship the release on Friday once the final checks have passed, not before."
            fake.behaviour.pieces = [answer]
            with httpx.Client(base_url=url, timeout=30) as first:  # a new connection: either worker may take it
                first.post("/v1/chat/completions", json={"model": "fake", "messages": [
                    {"role": "system", "content": "You are the planner."},
                    {"role": "user", "content": f"Plan release {i}."}]}).raise_for_status()
            fake.behaviour.pieces = ["Agreed."]
            with httpx.Client(base_url=url, timeout=30) as second:
                second.post("/v1/chat/completions", json={"model": "fake", "messages": [
                    {"role": "system", "content": "You are the reviewer."},
                    {"role": "user", "content": f"Review this plan:\n\n{answer}"}]}).raise_for_status()
            segments = fake.received[-1].body["kv_transfer_params"]["kvrelay"]["segments"]
            found += any(s["kind"] == "placeholder" for s in segments)
            for _ in range(4):
                with httpx.Client(base_url=url, timeout=10) as probe:
                    text = probe.get("/metrics").text
                replicas.add(next(line for line in text.splitlines()
                                  if line.startswith('kvrelay_replication_observations_total{fate="published"}')))
        assert found == 12  # every quote found, whichever worker relayed the answer
        assert len(replicas) >= 2  # /metrics answered by two processes (their own counters)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        fake.stop()


def test_workers_refuse_a_database_they_cannot_share():
    result = subprocess.run([*KVRELAY, "gateway", "--workers", "2", "--database-url",
                             "sqlite+aiosqlite:///:memory:"], env=_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "replication needs a database the replicas share" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
