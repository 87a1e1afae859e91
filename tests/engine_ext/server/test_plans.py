"""The engine server follows a plan only when it may: with a seal configured, only the
gateway's sealed plans; a forged, stale or malformed plan runs the request densely
under the default tenant, with a warning and a count in /metrics, never an error."""

from __future__ import annotations

import hashlib
import logging

import httpx
import pytest

from engine_ext.config import EngineConfig, ReuseConfig
from engine_ext.engine import LLMEngine
from kvrelay.wire.seal import SEAL_KEY, PlanSeal
from kvrelay.wire.plan import PLAN_KEY, Segment, SegmentPlan

SECRET = "engine-plan-secret-" + "z" * 16
MODEL = "smollm2"
DOC = "The harbour ledger lists wool, salt and timber shipments for every month of the year. " * 4


@pytest.fixture(scope="module")
def srv(smollm2_dir, run_server):
    llm = LLMEngine(smollm2_dir, EngineConfig(kv_cache_bytes=256 * 2**20, reuse=ReuseConfig(min_segment_tokens=8)),
                    model_name=MODEL)
    with run_server(llm, MODEL, None, PlanSeal(SECRET, max_age_s=60)) as server:
        yield server


def _params(prefix: str, seal: PlanSeal | None, tamper: dict | None = None, issued: float | None = None) -> dict:
    start = len(prefix)
    segment = Segment(message_index=0, char_start=start, char_end=start + len(DOC), kind="shared_block",
                      content_hash=hashlib.sha256(DOC.encode()).hexdigest(), method="shift")
    plan = SegmentPlan(session_id="s", agent_id="a", request_id=f"r-{prefix[:4]}", segments=[segment],
                       app_id="app", tenant="team-a").model_dump(mode="json")
    params = {PLAN_KEY: plan}
    if seal is not None:
        params[SEAL_KEY] = seal.seal(plan, now=issued)
    if tamper:
        params[PLAN_KEY] = {**plan, **tamper}
    return params


def _ask(srv, prefix: str, params: dict) -> dict:
    body = {"model": MODEL, "prompt": prefix + DOC + "\nWhich shipment was largest?", "max_tokens": 1,
            "temperature": 0, "kv_transfer_params": params}
    r = httpx.post(f"{srv.v1}/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text  # an ignored plan is never the user's error
    return r.json()


def _ignored(srv) -> dict[str, float]:
    text = httpx.get(f"{srv.base_url}/metrics").text
    return {line.split('"')[1]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("kvrelay_engine_plans_ignored_total{")}


def test_only_sealed_fresh_unaltered_plans_are_followed(srv, caplog):
    seal = PlanSeal(SECRET)
    before = _ignored(srv)
    # Prefixes end with a newline: the document then starts on a token edge, so the plan can place it.
    _ask(srv, "First,\n", _params("First,\n", seal))  # caches the document for team-a
    followed = _ask(srv, "Then again:\n", _params("Then again:\n", seal))
    assert followed["kv_transfer_params"]["kvrelay_reuse"]["segments"][0]["method"] == "shift"
    forgeries = [
        lambda prefix: _params(prefix, None),  # unsealed
        lambda prefix: _params(prefix, PlanSeal("not-the-secret-" + "q" * 16)),  # forged
        lambda prefix: _params(prefix, seal, tamper={"tenant": "team-b"}),  # altered after sealing: forged
        lambda prefix: _params(prefix, seal, issued=0),  # stale
    ]
    with caplog.at_level(logging.WARNING, logger="engine_ext.server.plans"):
        for i, forgery in enumerate(forgeries):
            prefix = f"Attempt {i}:\n"
            warm = _ask(srv, prefix, _params(prefix, seal))  # team-a computes this very prompt
            assert warm["kv_transfer_params"]["kvrelay_reuse"]["segments"][0]["method"] == "shift"
            reply = _ask(srv, prefix, forgery(prefix))
            assert "kvrelay_reuse" not in reply.get("kv_transfer_params", {})  # no plan followed: dense
            assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # nothing of team-a's
    after = _ignored(srv)
    assert {k: after[k] - before.get(k, 0) for k in after} == {"unsealed": 1, "malformed": 0, "forged": 2, "stale": 1}
    assert sum("ignoring a segment plan" in r.message for r in caplog.records) == 4


def test_a_sealed_but_malformed_plan_is_ignored_not_refused(srv):
    before = _ignored(srv)["malformed"]
    plan = {"version": 1, "segments": "nonsense"}
    reply = _ask(srv, "Once more: ", {PLAN_KEY: plan, SEAL_KEY: PlanSeal(SECRET).seal(plan)})
    assert reply["choices"][0]["text"] is not None and "kvrelay_reuse" not in reply.get("kv_transfer_params", {})
    assert _ignored(srv)["malformed"] == before + 1


def test_requests_nobody_vouched_for_share_no_cache(srv):
    body = {"model": MODEL, "prompt": "Count the ships in the harbour, one by one. " * 8, "max_tokens": 1,
            "temperature": 0}
    first, second = (httpx.post(f"{srv.v1}/completions", json=body, timeout=60).json() for _ in range(2))
    # On an engine that follows only sealed plans, a plan-less request has a tenant of its own.
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_a_plan_the_engine_cannot_even_encode_is_a_400_naming_it(srv):
    # JSON allows a lone surrogate escape; Python strings hold it; UTF-8 cannot encode it.
    raw = (b'{"model": "smollm2", "prompt": "Surrogates", "max_tokens": 1, "kv_transfer_params": '
           b'{"kvrelay": {"version": 1, "session_id": "\\ud800", "segments": []}, '
           b'"kvrelay_seal": {"t": 1, "mac": "\\ud800"}}}')
    r = httpx.post(f"{srv.v1}/completions", content=raw, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "kv_transfer_params" and "kvrelay.session_id" in error["message"]
    body = {"model": MODEL, "prompt": "Surrogates", "max_tokens": 1, "temperature": 0}
    assert httpx.post(f"{srv.v1}/completions", json=body, timeout=60).status_code == 200


def test_the_engine_never_echoes_a_plan_or_seal(srv):
    seal = PlanSeal(SECRET)
    reply = _ask(srv, "Echo: ", _params("Echo: ", seal))
    assert PLAN_KEY not in reply["kv_transfer_params"] and SEAL_KEY not in reply["kv_transfer_params"]


def _salted(srv, prompt: str, salt: str | None) -> int:
    """Cached tokens of a sealed request of team-a that reads prefix caches only."""
    plan = SegmentPlan(session_id="s", agent_id="a", request_id="salted", segments=[], app_id="app",
                       tenant="team-a").model_dump(mode="json")
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0,
            "kv_transfer_params": {PLAN_KEY: plan, SEAL_KEY: PlanSeal(SECRET).seal(plan)}}
    if salt is not None:
        body["cache_salt"] = salt
    r = httpx.post(f"{srv.v1}/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_cache_salt_splits_a_tenant_s_cache_as_it_splits_vllm_s(srv):
    prompt = "The salt cellar of the guild keeps its own ledger of every barrel and sack. " * 4
    assert _salted(srv, prompt, "s1") == 0
    assert _salted(srv, prompt, "s1") >= 48  # the control: the same tenant and salt hit (whole blocks)
    assert _salted(srv, prompt, "s2") == 0  # the same tenant, another salt: nothing
    assert _salted(srv, prompt, None) == 0  # and the tenant without a salt: nothing either


@pytest.mark.parametrize("salt", ["", 5, "a@b", "x" * 129])
def test_a_bad_cache_salt_is_a_400_naming_it(srv, salt):
    for path, body in (("completions", {"prompt": "Hi"}), ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
                       ("responses", {"input": "Hi"})):
        r = httpx.post(f"{srv.v1}/{path}", json={"model": MODEL, "max_tokens": 1, **body, "cache_salt": salt}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", (path, r.text)
