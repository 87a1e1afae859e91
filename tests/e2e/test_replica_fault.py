"""One of two gateway replicas killed (SIGKILL) mid-run: no answered request loses its
record, and the other replica keeps planning with what the killed one shared."""

from __future__ import annotations

import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from tests.gateway.support import Behaviour, FakeUpstream
from tests.helpers import wait_until



def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _replica(n: int, upstream: str, db: Path, journal: Path, port: int) -> subprocess.Popen[bytes]:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("KVRELAY_", "OTEL_"))},
           "KVRELAY_UPSTREAMS": f'["{upstream}"]', "KVRELAY_DATABASE_URL": f"sqlite+aiosqlite:///{db}",
           "KVRELAY_REPLICATION__ENABLED": "true", "KVRELAY_REPLICATION__REPLICA_ID": f"replica-{n}",
           "KVRELAY_RECORD_JOURNAL_DIR": str(journal), "KVRELAY_RECORD_BATCH_SIZE": "8"}
    proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "kvrelay.gateway.app:create_app", "--factory",
                             "--port", str(port), "--log-level", "warning"], env=env)

    def up() -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    assert wait_until(up, timeout=60, interval=0.1), f"replica {n} did not start"
    return proc


def _ask(url: str, messages: list[dict]) -> str | None:
    """The request's record id, or None when the replica did not answer."""
    try:
        reply = httpx.post(f"{url}/v1/chat/completions", timeout=30,
                           json={"model": "fake", "messages": messages, "stream": True})
    except httpx.HTTPError:
        return None
    return reply.headers.get("x-kvrelay-request-id") if reply.status_code == 200 and "[DONE]" in reply.text else None


def test_a_killed_replica_loses_no_record_and_the_other_keeps_planning(tmp_path):
    fake = FakeUpstream(Behaviour(pieces=["Planner: we ship on Friday once the final checks pass, not before."]))
    db = tmp_path / "shared.sqlite"
    ports = [_port(), _port()]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    replicas = [_replica(n, fake.url, db, tmp_path / f"journal-{n}", ports[n]) for n in range(2)]
    answered: list[str] = []
    try:
        quoted = fake.behaviour.pieces[0]
        first = _ask(urls[1], [{"role": "system", "content": "You are the planner of a release team."},
                                   {"role": "user", "content": "Plan the Friday release."}])
        assert first is not None
        answered.append(first)
        fake.behaviour.pieces = ["Noted, working on it."]
        with ThreadPoolExecutor(8) as pool:
            def load(first: int, count: int) -> list[str | None]:
                return list(pool.map(lambda i: _ask(urls[i % 2], [
                    {"role": "system", "content": "You are the planner of a release team."},
                    {"role": "user", "content": f"Plan release {i} of the mobile app."}]), range(first, first + count)))

            answered += [r for r in load(0, 40) if r]
            killer = pool.submit(lambda: (time.sleep(0.05), replicas[1].send_signal(signal.SIGKILL)))
            during = load(40, 80)
            killer.result()
            answered += [r for r in during if r]
        replicas[1].wait(10)
        assert len(answered) >= 60  # replica 0 answered all its share; replica 1 until it died

        # The survivor plans with what the dead replica shared: a prompt quoting the answer
        # only replica 1 relayed, before it died, gets its placeholder there.
        fake.behaviour.pieces = ["Reviewer: agreed."]
        reply = httpx.post(f"{urls[0]}/v1/chat/completions", timeout=30, json={"model": "fake", "messages": [
            {"role": "system", "content": "You are the reviewer of a release team."},
            {"role": "user", "content": f"Review this plan:\n\n{quoted}"}]})
        assert reply.status_code == 200
        segments = fake.received[-1].body["kv_transfer_params"]["kvrelay"]["segments"]
        assert any(s["kind"] == "placeholder" for s in segments)
        assert httpx.get(f"{urls[0]}/ready", timeout=5).status_code == 200

        # The killed replica restarts on its journal and writes what it had not.
        replicas[1] = _replica(1, fake.url, db, tmp_path / "journal-1", ports[1])
    finally:
        for proc in replicas:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(30)
        fake.stop()
    with sqlite3.connect(db) as conn:
        recorded = {row[0] for row in conn.execute("SELECT id FROM requests")}
    assert set(answered) <= recorded, f"{len(set(answered) - recorded)} answered requests have no record"
