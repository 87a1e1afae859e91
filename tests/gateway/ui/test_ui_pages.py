"""/ui without a browser: who may open it, what an unknown session gets, and that text
from traffic is escaped, never run as markup."""

from __future__ import annotations

import json
from urllib.parse import quote

import pytest

from kvrelay.gateway.ui.waterfall import methods_drawn, waterfall_svg

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
        token = c.cookies.get("kvrelay_ui")
        assert c.get("/admin/sessions", headers={"cookie": f"kvrelay_ui={token}"}).status_code == 401  # /ui only
        c.post("/ui/logout", follow_redirects=False)
        assert c.get("/ui").status_code == 401
        c.cookies.set("kvrelay_ui", ADMIN)  # the raw key is not a session token
        assert c.get("/ui").status_code == 401
        assert c.get("/ui", headers={"Authorization": f"Bearer {ADMIN}"}).status_code == 200
        missing = c.get("/ui/sessions/nobody", headers={"Authorization": f"Bearer {ADMIN}"})
        assert missing.status_code == 404 and "nobody" in missing.text


def test_login_refuses_cross_site_posts_and_oversized_forms(fake_upstream, start_gateway):
    gw = start_gateway([fake_upstream().url], admin_key=ADMIN)
    form = {"content-type": "application/x-www-form-urlencoded"}
    with gw.client() as c:
        evil = c.post("/ui/login", content=f"key={ADMIN}", headers={**form, "origin": "http://evil.example"})
        fetched = c.post("/ui/login", content=f"key={ADMIN}", headers={**form, "sec-fetch-site": "cross-site"})
        huge = c.post("/ui/login", content="key=" + "a" * 10_000, headers=form)
        logout = c.post("/ui/logout", headers={"origin": "http://evil.example"})
        page = c.get("/ui")
    assert evil.status_code == fetched.status_code == logout.status_code == 403
    assert "set-cookie" not in evil.headers and huge.status_code == 413
    assert page.headers["x-frame-options"] == "DENY"
    assert "frame-ancestors 'none'" in page.headers["content-security-policy"]


def test_an_old_or_forged_token_opens_nothing():
    from kvrelay.gateway.ui.access import SESSION_TTL_S, _valid_token, ui_token

    now = 2_000_000_000
    assert _valid_token(ui_token(ADMIN, now - 60), ADMIN, now)
    assert not _valid_token(ui_token(ADMIN, now - SESSION_TTL_S - 1), ADMIN, now)  # expired
    assert not _valid_token(ui_token(ADMIN, now + 3600), ADMIN, now)  # issued in the future
    assert not _valid_token(ui_token("another-admin-key-0000", now), ADMIN, now)  # another key
    assert not _valid_token(f"{now}.deadbeef", ADMIN, now) and not _valid_token("", ADMIN, now)


def test_without_an_admin_key_only_loopback_clients_get_the_page():
    from types import SimpleNamespace

    from starlette.requests import Request

    from kvrelay.gateway.ui.access import is_allowed

    state = SimpleNamespace(settings=SimpleNamespace(admin_key=None, require_api_key=False))

    def request(host: str) -> Request:
        return Request({"type": "http", "method": "GET", "path": "/ui", "headers": [], "client": (host, 5000)})

    assert is_allowed(request("127.0.0.1"), state) and is_allowed(request("::1"), state)
    assert not is_allowed(request("10.0.0.5"), state) and not is_allowed(request("172.17.0.1"), state)


def test_hostile_text_in_a_breakdown_and_names_is_escaped_on_the_session_page(fake_upstream, start_gateway):
    report = {"ttft_s": 0.1, "queue_s": 0.01, "prefill_s": 0.08, "prefill_compute_s": 0.05, "prefill_wait_s": 0.0,
              "first_s": 0.01, "assembly_s": {"<img src=x onerror=alert(1)>": 0.03}}
    final = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "fake",
             "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
             "kv_transfer_params": {"kvrelay_ttft": report}}
    content = {**final, "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]}
    raw = [f"data: {json.dumps(content)}\n\n".encode(), f"data: {json.dumps(final)}\n\n".encode(), b"data: [DONE]\n\n"]
    gw = start_gateway([fake_upstream(raw_stream=raw).url])
    evil = "<script>alert(2)</script>"
    with gw.client() as c:
        c.post("/v1/chat/completions", headers={"x-kvrelay-session-id": evil, "x-kvrelay-agent-id": evil},
               json={"model": "fake", "stream": True, "messages": [{"role": "user", "content": "hi"}]}).read()
        gw.rows(1)
        page = c.get(f"/ui/sessions/{quote(evil, safe='')}")
    assert page.status_code == 200 and "KV assembly, &lt;img" in page.text  # the breakdown reached the page
    assert "<img src=x" not in page.text and evil not in page.text


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

    from kvrelay.gateway.ui.router import _script_json

    hostile = [{"data": {"id": "</script><!--<script>&"}}]
    text = _script_json(hostile)
    assert not any(c in text for c in "<>&") and json.loads(text) == hostile
