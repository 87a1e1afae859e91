"""/ui without a browser: who may open it, what an unknown session gets, and that text
from traffic is escaped, never run as markup."""

from __future__ import annotations

import pytest

from gateway.ui.waterfall import waterfall_svg

ADMIN = "admin-" + "s3cret" * 4


def test_with_an_admin_key_the_page_asks_for_it_once(fake_upstream, start_gateway):
    gw = start_gateway([fake_upstream().url], admin_key=ADMIN)
    with gw.client() as c:
        assert c.get("/ui").status_code == 401 and 'name="key"' in c.get("/ui").text
        assert c.post("/ui/login", content="key=wrong", headers={"content-type": "application/x-www-form-urlencoded"},
                      follow_redirects=False).status_code == 401
        ok = c.post("/ui/login", content=f"key={ADMIN}", follow_redirects=False,
                    headers={"content-type": "application/x-www-form-urlencoded"})
        assert ok.status_code == 303 and "httponly" in ok.headers["set-cookie"].lower()
        assert c.get("/ui", headers={"Authorization": f"Bearer {ADMIN}"}).status_code == 200
        c.cookies.set("kvrelay_admin", ADMIN)
        assert c.get("/ui").status_code == 200
        missing = c.get("/ui/sessions/nobody", headers={"Authorization": f"Bearer {ADMIN}"})
        assert missing.status_code == 404 and "nobody" in missing.text


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


@pytest.mark.parametrize("requests", [[], [{"engine": None}]])
def test_a_waterfall_without_engine_reports_says_so(requests):
    assert "No request carries" in waterfall_svg(requests)


def test_graph_json_cannot_end_its_script_element():
    import json

    from gateway.ui.router import _script_json

    hostile = [{"data": {"id": "</script><!--<script>&"}}]
    text = _script_json(hostile)
    assert not any(c in text for c in "<>&") and json.loads(text) == hostile
