"""GET /admin/sessions/{id}/ttft and `kvrelay ttft`: a session's requests through the
gateway to the embedded engine, each with the engine's TTFT breakdown, per round and
in total; unknown sessions are a clear 404 or one-line error."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from engine_ext.config import EngineConfig
from engine_ext.engine import LLMEngine
from tests.kvrelay.test_cli import run_cli

ADMIN = "admin-" + "s3cret" * 4
MODEL = "smollm2"
HEADERS = {"x-kvrelay-session-id": "town"}


@pytest.fixture(scope="module")
def srv(smollm2_dir, run_server):
    """SmolLM2: real text, so the gateway finds the villagers' outputs in later prompts."""
    llm = LLMEngine(smollm2_dir, EngineConfig(kv_cache_bytes=256 * 2**20), model_name=MODEL)
    with run_server(llm, MODEL) as server:
        yield server


def _ask(client: openai.OpenAI, agent: int, content: str) -> str:
    system = f"You are villager {agent} of a small town. Reply with one sentence."
    r = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=24, extra_headers=HEADERS,
                                       messages=[{"role": "system", "content": system},
                                                 {"role": "user", "content": content}])
    return r.choices[0].message.content


def test_a_session_s_ttft_per_request_per_round_and_in_total(srv, start_gateway):
    gw = start_gateway([srv.base_url], admin_key=ADMIN)
    with openai.OpenAI(base_url=gw.v1, api_key="unused", max_retries=0) as client:
        outputs = [_ask(client, k, f"Day starts. Your plan number {k}.") for k in range(3)]
        heard = "What your neighbours said:\n\n" + "\n\n".join(outputs) + "\n\nWhat next?"
        _ask(client, 0, heard)
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda k: _ask(client, k, heard), (1, 2)))
    rows = gw.rows(6)
    with gw.client(headers={"Authorization": f"Bearer {ADMIN}"}) as admin:
        report = admin.get("/admin/sessions/town/ttft").json()
        text = admin.get("/admin/sessions/town/ttft", params={"format": "text"}).text
        missing = admin.get("/admin/sessions/nobody/ttft")
    assert [r["request_id"] for r in report["requests"]] == [row.id for row in rows]
    assert all(r["engine"]["ttft_s"] > 0 for r in report["requests"])
    assert report["totals"]["num_requests"] == 6
    assert report["totals"]["ttft_s"] == pytest.approx(sum(r["engine"]["ttft_s"] for r in report["requests"]))
    in_rounds = [r for r in report["requests"] if r["round_id"] is not None]
    assert in_rounds and sum(r["num_requests"] for r in report["rounds"]) == len(in_rounds)
    assert text.splitlines()[0].split()[:4] == ["request", "agent", "round", "queue"] and "total" in text
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "session_not_found"
    cli = run_cli("ttft", "town", "--database-url", f"sqlite+aiosqlite:///{gw.db_path}")
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout.splitlines()[0].startswith("request") and "6 requests" in cli.stdout
    absent = run_cli("ttft", "nobody", "--database-url", f"sqlite+aiosqlite:///{gw.db_path}")
    assert absent.returncode != 0 and absent.stderr.strip().count("\n") == 0 and "no requests" in absent.stderr
