"""Tenants through the gateway: each API key's requests read and fill only their own
engine caches (cached_tokens 0 on another tenant's text), pairs configured to share
do, and the engine follows only the plans the gateway built and sealed."""

from __future__ import annotations

import openai
import pytest

from engine_ext.config import EngineConfig
from engine_ext.engine import LLMEngine
from kvrelay.wire.seal import PlanSeal

MODEL = "smollm2"
ADMIN = "admin-" + "s3cret" * 4
SECRET = "gateway-engine-" + "k" * 20
LONG = "The council of the old town met at dawn to count the harvest, the wool and the salt. " * 8


@pytest.fixture(scope="module")
def srv(smollm2_dir, run_server):
    llm = LLMEngine(smollm2_dir, EngineConfig(kv_cache_bytes=256 * 2**20), model_name=MODEL)
    with run_server(llm, MODEL, None, PlanSeal(SECRET)) as server:
        yield server


def _ask(gw, api_key: str, app: str | None = None, content: str = LONG) -> openai.types.chat.ChatCompletion:
    headers = {"x-kvrelay-app": app} if app else {}
    with openai.OpenAI(base_url=gw.v1, api_key=api_key, max_retries=0) as client:
        return client.chat.completions.create(model=MODEL, max_tokens=2, temperature=0, extra_headers=headers,
                                              messages=[{"role": "user", "content": content}])


def _cached(reply) -> int:
    return reply.usage.prompt_tokens_details.cached_tokens


def test_a_tenant_gets_no_cache_hit_on_another_tenants_text(srv, start_gateway):
    gw = start_gateway([srv.base_url], admin_key=ADMIN, require_api_key=True, plan_secret=SECRET)
    with gw.client(headers={"Authorization": f"Bearer {ADMIN}"}) as admin:
        key_a, key_b = (admin.post("/admin/keys", json={"name": n}).json()["key"] for n in ("a", "b"))
    first_a = _ask(gw, key_a)
    second_a = _ask(gw, key_a)
    first_b = _ask(gw, key_b)
    second_b = _ask(gw, key_b)
    assert _cached(first_a) == 0 and _cached(second_a) > 100  # the control: a tenant reuses its own text
    assert _cached(first_b) == 0  # nothing of tenant a's: no hit, so no TTFT gain
    assert _cached(second_b) == _cached(second_a)  # b's own cache works as a's does
    rows = {row.id: row for row in gw.rows(4)}
    assert sorted(row.cached_tokens for row in rows.values()) == [0, 0, _cached(second_a), _cached(second_a)]
    assert {(reply.model_extra or {}).get("kv_transfer_params", {}).get("kvrelay") for reply in
            (first_a, second_a, first_b)} == {None}  # plans (tenants, hashes) never reach a client


def test_tenants_configured_as_a_pair_share_and_no_one_else(srv, start_gateway):
    gw = start_gateway([srv.base_url], plan_secret=SECRET,
                       inference={"shared_caches": [["team-a", "team-c"]]})
    text = "A different ledger: timber, rope and tar for the shipyard, counted twice. " * 8
    assert _cached(_ask(gw, "unused", "team-a", text)) == 0
    assert _cached(_ask(gw, "unused", "team-c", text)) > 100  # a and c share
    assert _cached(_ask(gw, "unused", "team-b", text)) == 0  # b is in no pair


def test_overlapping_groups_are_refused_at_startup():
    from pydantic import ValidationError

    from kvrelay.gateway.settings import InferenceSettings

    with pytest.raises(ValidationError, match="two groups"):
        InferenceSettings(shared_caches=[["a", "b"], ["b", "c"]])
    with pytest.raises(ValidationError, match="fewer than two"):
        InferenceSettings(shared_caches=[["a"]])


def test_a_client_plan_is_dropped_and_the_gateway_seals_its_own(fake_upstream, start_gateway):
    up = fake_upstream()
    gw = start_gateway([up.url], plan_secret=SECRET)
    forged = {"kvrelay": {"version": 1, "session_id": "x", "agent_id": None, "request_id": "x", "segments": [],
                          "tenant": "someone-else"}, "kvrelay_seal": {"t": 1, "mac": "0" * 64}, "other": 1}
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "kv_transfer_params": forged}
    with gw.client() as c:
        c.post("/v1/chat/completions", json=body, headers={"x-kvrelay-reuse": "off"})
        c.post("/v1/chat/completions", json=body)
    off, on = (r.body["kv_transfer_params"] for r in up.received)
    assert off["other"] == 1 and off["kvrelay"]["segments"] == []  # reuse off: a plan that only names the tenant
    assert off["kvrelay"]["tenant"] == "app:default" and PlanSeal(SECRET).check(off["kvrelay"], off["kvrelay_seal"]).accepted
    assert on["other"] == 1 and on["kvrelay"]["tenant"] == "app:default" and on["kvrelay"]["session_id"] != "x"
    assert PlanSeal(SECRET).check(on["kvrelay"], on["kvrelay_seal"]).accepted


def test_every_request_carries_its_tenant_s_salt_never_the_client_s(fake_upstream, start_gateway):
    up = fake_upstream()
    gw = start_gateway([up.url], plan_secret=SECRET, inference={"shared_caches": [["team-a", "team-c"]]})

    def send(app: str, **fields) -> None:
        body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], **fields}
        with gw.client() as c:
            assert c.post("/v1/chat/completions", json=body, headers={"x-kvrelay-app": app}).status_code == 200

    send("team-a")
    send("team-a", stream=True)
    send("team-c")  # shares team-a's namespace
    send("team-b")
    send("team-a", cache_salt="user-1")
    send("team-b", cache_salt="user-1")
    salts = [r.body["cache_salt"] for r in up.received]
    assert salts[0] == salts[1] == salts[2] != salts[3]
    assert len({salts[0], salts[3], salts[4], salts[5], "user-1"}) == 5  # the client's splits, never joins
    with gw.client() as c:
        reply = c.post("/v1/responses", json={"model": "fake", "input": "hi"}, headers={"x-kvrelay-app": "team-a"})
    assert reply.status_code == 200 and up.received[-1].body["cache_salt"] == salts[0]


@pytest.mark.parametrize("salt", ["", 7, "a/b", "x" * 129])
def test_a_bad_client_salt_is_a_400_naming_the_field(fake_upstream, start_gateway, salt):
    up = fake_upstream()
    gw = start_gateway([up.url])
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "cache_salt": salt}
    with gw.client() as c:
        reply = c.post("/v1/chat/completions", json=body)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "cache_salt", reply.text
    assert up.received == [] and gw.rows(1)[0].status == "client_error"
