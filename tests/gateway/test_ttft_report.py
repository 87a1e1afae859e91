"""GET /admin/sessions/{id}/ttft, `kvrelay ttft` and /ui: a session's requests through the
gateway to the embedded engine, each with the engine's TTFT breakdown, per round and
in total, the same figures in every view; unknown sessions are a clear 404 or one-line
error. (tests/gateway/test_ttft_estimate.py checks the saving against a measured replay.)"""

from __future__ import annotations

import html
import json
import re

import openai
import pytest

from tests.gateway.town import MODEL, TOWN_TIMEOUTS, NUM_REQUESTS, run_town_session, town_engine
from tests.kvrelay.test_cli import run_cli

ADMIN = "admin-" + "s3cret" * 4


@pytest.fixture(scope="module")
def srv(smollm2_dir, run_server):
    with run_server(town_engine(smollm2_dir), MODEL) as server:
        yield server


@pytest.mark.slow
def test_a_session_s_ttft_per_request_per_round_and_in_total(srv, start_gateway):
    gw = start_gateway([srv.base_url], admin_key=ADMIN, timeouts=TOWN_TIMEOUTS)
    run_town_session(gw.v1)
    rows = gw.rows(NUM_REQUESTS)
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
    (round_,) = report["rounds"]  # the two villagers who read every output at once
    members = [r["engine"] for r in in_rounds]
    assert round_["stages_s"]["queue_s"] == pytest.approx(sum(m["queue_s"] for m in members))
    # The members overlap: the round's wall-clock TTFT is under their sum, over the longest.
    assert max(m["ttft_s"] for m in members) <= round_["wall_ttft_s"] < round_["ttft_s"]
    engines = [r["engine"] for r in report["requests"]]
    priced = [b for b in engines if "saved_s" in b]
    totals = report["totals"]
    assert totals["num_priced"] == len(priced) and all("prefix_hit_tokens" in b for b in engines)
    assert all(b["saved_s"] == pytest.approx(b["dense_ttft_s"] - b["ttft_s"]) for b in priced)
    assert totals["saved_s"] == pytest.approx(sum(b["saved_s"] for b in priced))
    assert totals["reused_tokens"] == sum(b["reused_tokens"] for b in engines)
    if totals["reused_tokens"] == 0:  # exact reuse only (the default): the prefix path's own work, saving 0
        assert totals["num_priced"] == 6 and totals["saved_s"] == 0.0
    assert text.splitlines()[0].split()[:5] == ["request", "agent", "round", "prep", "queue"] and "total" in text
    assert "wall " in text
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "session_not_found"
    cli = run_cli("ttft", "town", "--database-url", f"sqlite+aiosqlite:///{gw.db_path}")
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout.splitlines()[0].startswith("request") and "6 requests" in cli.stdout
    assert cli.stdout.strip() == text.strip()  # the table the admin API prints
    as_json = run_cli("ttft", "town", "--json", "--database-url", f"sqlite+aiosqlite:///{gw.db_path}")
    assert json.loads(as_json.stdout) == report
    # /ui shows the same computation: the totals, and each request's saving.
    with gw.client(headers={"Authorization": f"Bearer {ADMIN}"}) as admin:
        page = admin.get("/ui/sessions/town").text
    totals_line = " ".join(html.unescape(re.search(r'<p id="totals">(.*?)</p>', page, re.S).group(1)).split())
    assert f"TTFT saved {round(totals['saved_s'] * 1e3)} ms" in totals_line
    assert f"({totals['reused_tokens']} beyond the prefix cache)" in totals_line
    rows_saved = re.findall(r'<tr class="request">.*?<td class="num">([^<]*)</td></tr>', page, re.S)
    assert rows_saved == [str(round(b["saved_s"] * 1e3)) if "saved_s" in b else "?" for b in engines]
    absent = run_cli("ttft", "nobody", "--database-url", f"sqlite+aiosqlite:///{gw.db_path}")
    assert absent.returncode != 0 and absent.stderr.strip().count("\n") == 0 and "no requests" in absent.stderr


def test_requests_without_reuse_still_get_their_breakdown_which_clients_see_only_if_asked(srv, start_gateway):
    gw = start_gateway([srv.base_url], timeouts=TOWN_TIMEOUTS)
    seen = []
    with openai.OpenAI(base_url=gw.v1, api_key="unused", max_retries=0) as client:
        for stream, asked in ((False, False), (True, False), (False, True), (True, True)):
            headers = {"x-kvrelay-reuse": "off", **({"x-kvrelay-ttft": "1"} if asked else {})}
            reply = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=4, stream=stream,
                                                   messages=[{"role": "user", "content": "Say hello."}],
                                                   extra_headers=headers)
            last = list(reply)[-1] if stream else reply
            params = (last.model_extra or {}).get("kv_transfer_params") or {}
            seen.append("kvrelay_ttft" in params)
    assert seen == [False, False, True, True]
    for row in gw.rows(4):
        breakdown = json.loads(row.ttft_breakdown)
        assert breakdown["ttft_s"] > 0 and breakdown["prefill_compute_s"] > 0
