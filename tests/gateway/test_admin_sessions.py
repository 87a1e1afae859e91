"""GET /admin/sessions and /admin/sessions/{id}: inferred structure as JSON and Mermaid."""

from __future__ import annotations

import time

import openai

from tests.e2e.test_inference_e2e import run_loop

ADMIN = "admin-" + "s3cret" * 4


def _admin(gw):
    return gw.client(headers={"Authorization": f"Bearer {ADMIN}"})


def test_sessions_list_and_detail_show_agents_segments_rounds_and_the_step_graph(fake_upstream, start_gateway):
    fake = fake_upstream()
    gw = start_gateway([fake.url], admin_key=ADMIN)
    seen = run_loop(gw, fake, app="team-a")
    run_loop(gw, fake, app="team-b")
    session_id = seen[0][0].session_id
    with _admin(gw) as admin:
        listed = admin.get("/admin/sessions").json()["data"]
        assert {(s["app"], s["num_requests"]) for s in listed} == {("team-a", 4), ("team-b", 4)}
        assert [s["app"] for s in admin.get("/admin/sessions", params={"app": "team-b"}).json()["data"]] == ["team-b"]

        detail = admin.get(f"/admin/sessions/{session_id}").json()
        assert detail["app"] == "team-a" and detail["num_requests"] == 4
        assert len(detail["agents"]) == 3
        planner = seen[0][0].agent_id
        assert next(a for a in detail["agents"] if a["id"] == planner)["fixed_prefix_chars"] > 0
        kinds = [s["kind"] for s in detail["segments"]]
        assert kinds.count("question") == 1 and kinds.count("response") == 4
        names = {s["name"] for s in detail["segments"]}
        assert {"user_question", f"agent_{planner}_current", f"agent_{planner}_history_1"} <= names
        edges = {(e["source"], e["target"]) for e in detail["step_graph"]["edges"]}
        assert (planner, seen[1][0].agent_id) in edges
        assert detail["mermaid"].startswith("flowchart LR") and "-->" in detail["mermaid"]
        assert all("text" not in s for s in detail["segments"])  # hashes and sizes, never content

        text = admin.get(f"/admin/sessions/{session_id}", params={"format": "mermaid"})
        assert text.headers["content-type"].startswith("text/plain") and text.text.strip() == detail["mermaid"]


def test_unknown_ambiguous_and_unauthorised_session_lookups_get_clear_errors(fake_upstream, start_gateway):
    fake = fake_upstream(pieces=["An answer long enough to be remembered by the gateway as an output."])
    gw = start_gateway([fake.url], admin_key=ADMIN)
    for app in ("a", "b"):
        client = openai.OpenAI(base_url=gw.v1, api_key="x", max_retries=0,
                               default_headers={"x-kvrelay-app": app, "x-session-id": "same"})
        client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hello"}])
    with _admin(gw) as admin:
        r = admin.get("/admin/sessions/nope")
        assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"
        r = admin.get("/admin/sessions/same")
        assert r.status_code == 409 and "?app=" in r.json()["error"]["message"]
        assert admin.get("/admin/sessions/same", params={"app": "b"}).json()["app"] == "b"
        assert admin.get("/admin/sessions/same", params={"app": "c"}).status_code == 404
        assert admin.get("/admin/sessions", params={"limit": 0}).status_code == 400
        assert admin.get("/admin/sessions/same", params={"app": "a", "format": "svg"}).status_code == 400
    with gw.client() as anonymous:
        assert anonymous.get("/admin/sessions").status_code == 401


def test_a_session_no_longer_in_memory_is_shown_from_sql(fake_upstream, start_gateway):
    fake = fake_upstream()
    # The app runs under the default TTL: a short one here would split the session whenever the
    # machine is slow between two of its requests. Only the restarted gateway's TTL decides what
    # it loads at start-up.
    first = start_gateway([fake.url], admin_key=ADMIN)
    seen = run_loop(first, fake)
    first.server.stop()
    time.sleep(0.4)  # idle past the restarted gateway's TTL: not loaded at start-up
    gw = start_gateway([fake.url], admin_key=ADMIN, db_path=first.db_path, inference={"session_ttl_s": 0.3})
    session_id = seen[0][0].session_id
    with _admin(gw) as admin:
        assert admin.get("/admin/sessions").json()["data"] == []
        detail = admin.get(f"/admin/sessions/{session_id}").json()
        assert detail["num_requests"] == 4 and len(detail["segments"]) == 5 and detail["app"] == "default"
