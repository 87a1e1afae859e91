"""/ui without a browser: who may open it, what an unknown session gets, and that text
from traffic is escaped, never run as markup."""

from __future__ import annotations

import pytest

from gateway.ui.waterfall import methods_drawn, waterfall_svg

ADMIN = "admin-" + "s3cret" * 4


def test_with_an_admin_key_the_page_asks_for_it_once(fake_upstream, start_gateway):
    gw = start_gateway([fake_upstream().url], admin_key=ADMIN)
    with gw.client() as c:
        assert c.get("/ui").status_code == 401 and 'name="key"' in c.get("/ui").text
        assert c.post("/ui/login", content="key=wrong", headers={"content-type": "application/x-www-form-urlencoded"},
                      follow_redirects=False).status_code == 401
        ok = c.post("/ui/login", content=f"key={ADMIN}", follow_redirects=False,
                    headers={"content-type": "application/x-www-form-urlencoded"})
        cookie = ok.headers["set-cookie"].lower()
        assert ok.status_code == 303 and "httponly" in cookie and "path=/ui" in cookie and "samesite=strict" in cookie
        assert ADMIN.lower() not in cookie  # a token derived from the key, never the key
        assert c.get("/ui").status_code == 200  # the client kept the cookie
        assert c.get("/admin/sessions").status_code == 401  # the cookie opens /ui only
        c.post("/ui/logout", follow_redirects=False)
        assert c.get("/ui").status_code == 401
        c.cookies.set("kvrelay_ui", ADMIN)  # the raw key is not a session token
        assert c.get("/ui").status_code == 401
        assert c.get("/ui", headers={"Authorization": f"Bearer {ADMIN}"}).status_code == 200
        missing = c.get("/ui/sessions/nobody", headers={"Authorization": f"Bearer {ADMIN}"})
        assert missing.status_code == 404 and "nobody" in missing.text


def test_the_cookie_is_secure_behind_https(fake_upstream, start_gateway):
    gw = start_gateway([fake_upstream().url], admin_key=ADMIN)
    with gw.client() as c:
        ok = c.post("/ui/login", content=f"key={ADMIN}", follow_redirects=False,
                    headers={"content-type": "application/x-www-form-urlencoded", "x-forwarded-proto": "https"})
    assert "secure" in ok.headers["set-cookie"].lower()


def test_a_session_id_with_a_slash_links_to_its_page(fake_upstream, start_gateway):
    gw = start_gateway([fake_upstream().url])
    with gw.client() as c:
        c.post("/v1/chat/completions", headers={"x-kvrelay-session-id": "team/a?b#c"},
               json={"model": "fake", "messages": [{"role": "user", "content": "hi"}]})
        gw.rows(1)
        assert 'href="/ui/sessions/team%2Fa%3Fb%23c"' in c.get("/ui").text
        page = c.get("/ui/sessions/team%2Fa%3Fb%23c")
    assert page.status_code == 200 and "Session team/a?b#c" in page.text


def test_without_an_admin_key_the_page_is_open_only_while_client_keys_are_off(fake_upstream, start_gateway):
    open_gw = start_gateway([fake_upstream().url])
    with open_gw.client() as c:
        assert c.get("/ui").status_code == 200 and "No sessions yet" in c.get("/ui").text
        assert c.get("/ui/static/vendor/cytoscape.min.js").status_code == 200
    locked = start_gateway([fake_upstream().url], require_api_key=True)
    with locked.client() as c:
        assert c.get("/ui").status_code == 403


def test_session_ids_and_agent_names_are_escaped(fake_upstream, start_gateway):
    gw = start_gateway([fake_upstream().url])
    evil = "<script>alert(1)</script>"
    with gw.client() as c:
        c.post("/v1/chat/completions", headers={"x-kvrelay-session-id": evil, "x-kvrelay-agent-id": evil},
               json={"model": "fake", "messages": [{"role": "user", "content": "hi"}]})
        gw.rows(1)
        listing = c.get("/ui").text
    assert evil not in listing and "&lt;script&gt;" in listing


def test_the_waterfall_groups_a_round_and_splits_the_prefill():
    def request(rid: str, round_id: str | None, start: str, assembly: dict[str, float]) -> dict:
        engine = {"queue_s": 0.01, "plan_s": 0.001, "prefill_s": 0.2, "first_s": 0.005, "ttft_s": 0.216,
                  "assembly_s": assembly, "prefill_compute_s": 0.15, "prefill_wait_s": 0.05 - sum(assembly.values())}
        return {"request_id": rid, "agent_id": f"agent-{rid}", "round_id": round_id,
                "started_at": f"2026-11-23T10:00:{start}+00:00", "engine": engine}

    svg = waterfall_svg([request("a", None, "00", {}), request("b", "r1", "05", {"collective": 0.02}),
                         request("c", "r1", "05", {"collective": 0.02}), request("d", None, "09", {"shift": 0.01})])
    assert svg.count('<g class="group" data-kind="round">') == 1 and svg.count('data-kind="single"') == 2
    assert svg.count('<g class="request"') == 4
    assert svg.count("KV assembly, collective") == 2 and "KV assembly, shift" in svg
    assert svg.count("prefill compute: 150.0 ms") == 4 and "prefill wait between chunks" in svg
    assert methods_drawn([{"engine": {"assembly_s": {"shift": 1, "collective": 1}}}]) == ["shift", "collective"]


@pytest.mark.parametrize("requests", [[], [{"engine": None}]])
def test_a_waterfall_without_engine_reports_says_so(requests):
    assert "No request carries" in waterfall_svg(requests)


def test_graph_json_cannot_end_its_script_element():
    import json

    from gateway.ui.router import _script_json

    hostile = [{"data": {"id": "</script><!--<script>&"}}]
    text = _script_json(hostile)
    assert not any(c in text for c in "<>&") and json.loads(text) == hostile
