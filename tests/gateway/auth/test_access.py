"""API keys, the admin API and rate limits, through a running gateway."""

from __future__ import annotations

import asyncio
import logging
import time

import openai
import pytest
from sqlalchemy.ext.asyncio import create_async_engine

from kvrelay.gateway.auth import KeyStore

ADMIN = "admin-" + "s3cret" * 4
CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def keyed_gateway(fake_upstream, start_gateway, tmp_path, clean_env):
    """A gateway that requires keys, with the admin API on; returns (gateway, upstream, admin client)."""
    clean_env.setenv("KVRELAY_CACHE_DIR", str(tmp_path / "cache"))
    up = fake_upstream()
    gw = start_gateway([up.url], require_api_key=True, admin_key=ADMIN, key_refresh_s=0.2)
    admin = gw.client(headers={"Authorization": f"Bearer {ADMIN}"})
    yield gw, up, admin
    admin.close()


def create_key(admin, **fields) -> dict:
    r = admin.post("/admin/keys", json={"name": "app", **fields})
    assert r.status_code == 201, r.text
    return r.json()


def chat(gw, secret: str | None, body: dict | None = None):
    headers = {"Authorization": f"Bearer {secret}"} if secret else {}
    with gw.client() as c:
        return c.post("/v1/chat/completions", json=body or CHAT, headers=headers)


def test_requests_need_a_valid_key(keyed_gateway):
    gw, up, admin = keyed_gateway
    key = create_key(admin)
    assert chat(gw, key["key"]).status_code == 200
    for secret in (None, "kvr-not-a-key"):
        r = chat(gw, secret)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with gw.client() as c:
        r = c.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Basic abc"})
    assert r.status_code == 401
    assert len(up.received) == 1  # refused calls never reach the upstream
    rows = sorted(gw.rows(4), key=lambda row: row.started_at)
    assert rows[0].api_key_id == key["id"] and rows[0].status == "ok"
    assert [row.status for row in rows[1:]] == ["client_error"] * 3 and rows[1].api_key_id is None


def test_the_openai_client_authenticates_with_its_api_key(keyed_gateway):
    gw, _, admin = keyed_gateway
    key = create_key(admin)
    client = openai.OpenAI(base_url=gw.v1, api_key=key["key"], max_retries=0)
    assert client.chat.completions.create(**CHAT).choices[0].message.content == "Hello world"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=gw.v1, api_key="kvr-wrong", max_retries=0).chat.completions.create(**CHAT)


def test_a_revoked_key_stops_working_at_once(keyed_gateway):
    gw, _, admin = keyed_gateway
    key = create_key(admin)
    assert chat(gw, key["key"]).status_code == 200
    r = admin.delete(f"/admin/keys/{key['id']}")
    assert r.status_code == 200 and r.json()["revoked_at"] is not None
    assert chat(gw, key["key"]).status_code == 401
    assert admin.delete("/admin/keys/key_nope").status_code == 404


def test_a_key_revoked_in_another_process_stops_working_within_the_refresh(keyed_gateway):
    gw, _, admin = keyed_gateway
    key = create_key(admin)

    async def revoke() -> None:
        engine = create_async_engine(gw.state.settings.database_url)
        await KeyStore(engine).revoke(key["id"])
        await engine.dispose()

    asyncio.run(revoke())
    deadline = time.monotonic() + 5
    while chat(gw, key["key"]).status_code == 200:
        assert time.monotonic() < deadline, "the revoked key still works"
        time.sleep(0.05)


def test_admin_lists_keys_without_secrets(keyed_gateway):
    _, _, admin = keyed_gateway
    key = create_key(admin, requests_per_minute=5, tokens_per_minute=1000)
    listed = admin.get("/admin/keys").json()["data"]
    assert [k["id"] for k in listed] == [key["id"]]
    assert "key" not in listed[0] and key["key"] not in str(listed)
    assert (listed[0]["requests_per_minute"], listed[0]["tokens_per_minute"]) == (5, 1000)
    ups = admin.get("/admin/upstreams").json()["data"]
    assert ups[0]["healthy"] is True and ups[0]["models"] == ["fake"]


@pytest.mark.parametrize("body", [{}, {"name": ""}, {"name": "a", "requests_per_minute": 0},
                                  {"name": "a", "colour": "red"}])
def test_admin_refuses_bad_key_requests(keyed_gateway, body):
    _, _, admin = keyed_gateway
    r = admin.post("/admin/keys", json=body)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_admin_needs_the_admin_key_and_a_client_key_is_not_one(keyed_gateway):
    gw, _, admin = keyed_gateway
    key = create_key(admin)
    with gw.client() as c:
        for headers in ({}, {"Authorization": f"Bearer {key['key']}"}, {"Authorization": f"Bearer {ADMIN}x"}):
            r = c.get("/admin/keys", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "admin_unauthorized"


def test_admin_api_is_off_without_an_admin_key(fake_upstream, start_gateway):
    gw = start_gateway([fake_upstream().url])
    with gw.client() as c:
        r = c.get("/admin/keys", headers={"Authorization": "Bearer anything-at-all"})
    assert r.status_code == 403 and "KVRELAY_ADMIN_KEY" in r.json()["error"]["message"]


def test_requests_per_minute_limit_answers_429_with_retry_after(keyed_gateway):
    gw, up, admin = keyed_gateway
    key = create_key(admin, requests_per_minute=2)
    assert [chat(gw, key["key"]).status_code for _ in range(2)] == [200, 200]
    r = chat(gw, key["key"])
    assert r.status_code == 429 and 1 <= int(r.headers["retry-after"]) <= 30
    assert r.json()["error"]["type"] == "rate_limit_error"
    assert len(up.received) == 2
    assert sorted(row.status for row in gw.rows(3)) == ["ok", "ok", "rate_limited"]
    other = create_key(admin, requests_per_minute=2)  # limits are per key
    assert chat(gw, other["key"]).status_code == 200


def test_tokens_per_minute_counts_the_prompt_before_and_the_usage_after(keyed_gateway):
    gw, up, admin = keyed_gateway
    key = create_key(admin, tokens_per_minute=30)  # the fake reports 7 + 4 = 11 tokens per call
    big = {"model": "fake", "messages": [{"role": "user", "content": "word " * 40}]}
    r = chat(gw, key["key"], big)
    assert r.status_code == 429 and "exceeds this key's limit" in r.json()["error"]["message"]
    # "hi" is estimated at 5 tokens and settled at 11: 30 -> 19 -> 8 -> -3, then 5 cannot be paid
    responses = [chat(gw, key["key"]) for _ in range(4)]
    assert [r.status_code for r in responses] == [200, 200, 200, 429]
    assert 10 <= int(responses[-1].headers["retry-after"]) <= 17  # (5 + 3) tokens at 0.5 tokens/s
    assert len(up.received) == 3


def test_upstream_gets_its_own_key_never_the_clients(fake_upstream, start_gateway, tmp_path, clean_env):
    clean_env.setenv("KVRELAY_CACHE_DIR", str(tmp_path / "cache"))
    up = fake_upstream()
    gw = start_gateway([up.url], upstream_api_key="engine-secret")
    with gw.client() as c:
        assert c.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer client"}).status_code == 200
    assert up.received[-1].headers["authorization"] == "Bearer engine-secret"
    plain = fake_upstream()
    gw2 = start_gateway([plain.url])
    with gw2.client() as c:
        c.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer client"})
    assert "authorization" not in plain.received[-1].headers


def test_client_content_is_never_logged_at_info(keyed_gateway, caplog):
    gw, up, admin = keyed_gateway
    key = create_key(admin)
    secret_text = "TOP-SECRET-PROMPT-7f3a"
    caplog.set_level(logging.INFO)
    body = {"model": "fake", "messages": [{"role": "user", "content": secret_text}], "user": secret_text}
    headers = {"x-kvrelay-session-id": secret_text}
    with gw.client() as c:
        c.post("/v1/chat/completions", json=body, headers={**headers, "Authorization": f"Bearer {key['key']}"})
        c.post("/v1/chat/completions", json=body, headers={**headers, "Authorization": "Bearer kvr-bad"})
        c.post("/v1/chat/completions", content=secret_text.encode(), headers={"Authorization": f"Bearer {key['key']}"})
        up.behaviour.status = 500
        up.behaviour.error_message = secret_text
        c.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key['key']}"})
    gw.rows(4)
    logged = "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.INFO)
    assert secret_text not in logged and key["key"] not in logged
