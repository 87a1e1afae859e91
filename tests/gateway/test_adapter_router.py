"""AdapterRouter: which LoRA adapter a request runs on (the client's `base:adapter`, else
the first matching rule, else the base), its settings and adapters file, and the routed
model and plan as the upstream sees them, all adapters of a session on one upstream."""

from __future__ import annotations

import httpx
import pytest
from pydantic import ValidationError

from kvrelay.wire.plan import AdapterRef, read_plan
from kvrelay.gateway.adapters import AdapterRouter
from kvrelay.gateway.identity import identify
from kvrelay.gateway.inference import Inference
from kvrelay.gateway.settings import AdapterRule, AdapterSettings, Breaker, GatewaySettings, InferenceSettings
from kvrelay.gateway.upstreams import UpstreamPool

BASE = "smollm2-135m"
SERVED = [BASE, f"{BASE}:critic", f"{BASE}:math", f"{BASE}:code"]
CRITIC_SYSTEM = "You are the Critic. Find the flaws in the answer you are given."
PLANNER_SYSTEM = "You are the Planner. Break the task into small numbered steps."


def router(*rules: dict) -> AdapterRouter:
    return AdapterRouter([AdapterRule(**rule) for rule in rules])


def ref(name: str | None, base: str = BASE) -> AdapterRef:
    return AdapterRef(base=base, name=name)


# -- route() ---------------------------------------------------------------------------------
def test_the_clients_adapter_wins_over_every_rule():
    r = router({"agent": "*", "adapter": "critic"})
    assert r.route(f"{BASE}:math", "critic-1", CRITIC_SYSTEM) == ref("math")
    assert r.route("m:v1:b", "x", None) == AdapterRef(base="m:v1", name="b")  # adapter names have no ":"
    for odd in ("m:", ":a"):  # not an adapter reference: passes through as named, no rule applies
        assert r.route(odd, "critic", None) == AdapterRef(base=odd)
        assert r.route(odd, "critic", None).model == odd


def test_agent_glob():
    r = router({"agent": "critic*", "adapter": "critic"})
    assert r.route(BASE, "critic-1", None) == ref("critic")
    assert r.route(BASE, "critic", None) == ref("critic")
    assert r.route(BASE, "planner", None) == ref(None)
    assert r.route(BASE, "Critic-1", None) == ref(None)  # case-sensitive on every platform


def test_system_regex_is_searched():
    r = router({"system": r"(?i)\bthe critic\b", "adapter": "critic"})
    assert r.route(BASE, "agent-0123456789", CRITIC_SYSTEM) == ref("critic")
    assert r.route(BASE, "agent-0123456789", PLANNER_SYSTEM) == ref(None)
    assert r.route(BASE, "agent-0123456789", None) == ref(None)  # no system message: no match


def test_base_filter():
    r = router({"agent": "*", "base": BASE, "adapter": "critic"})
    assert r.route(BASE, "a", None) == ref("critic")
    assert r.route("other-model", "a", None) == AdapterRef(base="other-model")


def test_every_given_condition_must_match():
    r = router({"agent": "critic*", "system": "Critic", "adapter": "critic"})
    assert r.route(BASE, "critic-1", CRITIC_SYSTEM) == ref("critic")
    assert r.route(BASE, "critic-1", PLANNER_SYSTEM) == ref(None)
    assert r.route(BASE, "planner", CRITIC_SYSTEM) == ref(None)
    assert r.route(BASE, "critic-1", None) == ref(None)


def test_no_rule_or_no_match_runs_on_the_base():
    assert AdapterRouter().route(BASE, "critic", CRITIC_SYSTEM) == ref(None)
    assert router({"agent": "coder", "adapter": "code"}).route(BASE, "critic", None) == ref(None)


def test_the_first_matching_rule_wins_and_settings_rules_come_before_the_files(tmp_path):
    r = router({"agent": "critic-special", "adapter": "math"}, {"agent": "critic*", "adapter": "critic"},
               {"agent": "*", "adapter": "code"})
    names = [r.route(BASE, agent, None).name for agent in ("critic-special", "critic-2", "planner")]
    assert names == ["math", "critic", "code"]
    file = tmp_path / "adapters.yaml"
    file.write_text("rules:\n  - {agent: '*', adapter: code}\n")
    settings = AdapterSettings(rules=[AdapterRule(agent="critic*", adapter="critic")], file=file)
    routed = AdapterRouter.from_settings(settings)
    assert routed.num_rules == 2
    assert (routed.route(BASE, "critic-1", None), routed.route(BASE, "planner", None)) == (ref("critic"), ref("code"))


# -- settings --------------------------------------------------------------------------------
@pytest.mark.parametrize("rule,message", [
    ({"system": "([unclosed", "adapter": "critic"}, "not a valid regular expression"),
    ({"adapter": "critic"}, "needs `agent` or `system`"),
    ({"base": BASE, "adapter": "critic"}, "needs `agent` or `system`"),
    ({"agent": "critic*", "adapter": "base:critic"}, "adapter"),
    ({"agent": "critic*", "adapter": ""}, "adapter"),
    ({"agent": "critic*", "adapter": "team/critic"}, "adapter"),  # the engine refuses '/' in names
    ({"agent": "critic*", "base": f"{BASE}:math", "adapter": "critic"}, "base"),
    ({"agnet": "critic*", "system": "x", "adapter": "critic"}, "agnet"),  # a typo is an error, not a no-op
])
def test_invalid_rules(rule, message):
    with pytest.raises(ValidationError, match=message):
        AdapterRule(**rule)


def test_a_misspelt_adapters_setting_is_an_error():
    with pytest.raises(ValidationError, match="flie"):
        AdapterSettings(flie="adapters.yaml")


def test_adapters_file_from_the_environment(clean_env, tmp_path):
    file = tmp_path / "adapters.yaml"
    file.write_text("rules:\n  - agent: critic*\n    adapter: critic\n  - system: '(?i)you are the coder'\n"
                    "    base: smollm2-135m\n    adapter: code\n")
    clean_env.setenv("KVRELAY_ADAPTERS__FILE", str(file))
    settings = GatewaySettings()
    assert settings.adapters.file == file and settings.adapters.rules == []
    assert [(r.agent, r.system, r.base, r.adapter) for r in settings.adapters.all_rules] == [
        ("critic*", None, None, "critic"), (None, "(?i)you are the coder", BASE, "code")]
    assert GatewaySettings().adapters.all_rules == settings.adapters.all_rules
    assert AdapterSettings().all_rules == []


def test_adapters_in_the_yaml_config(clean_env, tmp_path):
    config = tmp_path / "gateway.yaml"
    config.write_text("adapters:\n  rules:\n    - {agent: 'critic*', adapter: critic}\n")
    clean_env.setenv("KVRELAY_CONFIG", str(config))
    assert [r.adapter for r in GatewaySettings().adapters.all_rules] == ["critic"]


def test_bad_adapters_files_stop_the_settings(clean_env, tmp_path):
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert AdapterSettings(file=empty).all_rules == []  # as an empty KVRELAY_CONFIG: nothing set
    missing = tmp_path / "missing.yaml"
    with pytest.raises(ValidationError, match=r"cannot read the adapters file .*missing\.yaml"):
        AdapterSettings(file=missing)
    clean_env.setenv("KVRELAY_ADAPTERS__FILE", str(missing))
    with pytest.raises(ValidationError, match="missing.yaml"):
        GatewaySettings()
    cases = {
        "list.yaml": ("- agent: x\n  adapter: y\n", "must hold a mapping"),
        "broken.yaml": ("rules: [\n", "cannot read the adapters file"),
        "regex.yaml": ("rules:\n  - {system: '(', adapter: critic}\n", r"rules\.0.*not a valid regular expression"),
        "nocond.yaml": ("rules:\n  - {adapter: critic}\n", r"rules\.0.*needs `agent` or `system`"),
        "extra.yaml": ("rules: []\nrulez: []\n", "rulez"),
    }
    for name, (text, message) in cases.items():
        path = tmp_path / name
        path.write_text(text)
        with pytest.raises(ValidationError, match=message) as info:
            AdapterSettings(file=path)
        assert name in str(info.value)


# -- the planner and the pool ----------------------------------------------------------------
def test_an_agent_inferred_from_an_unmodified_app_is_routed_by_its_system_prompt():
    """No header names the agent: the planner infers one from the system prompt, and the
    `system` rule picks its adapter; the plan carries base and adapter apart."""
    inference = Inference(InferenceSettings(), router({"system": r"^You are the Critic\.", "adapter": "critic"}))
    plans = []
    for i, system in enumerate((CRITIC_SYSTEM, PLANNER_SYSTEM, CRITIC_SYSTEM + " Be brief.")):
        body = {"model": BASE, "messages": [{"role": "system", "content": system},
                                            {"role": "user", "content": f"Question number {i}?"}]}
        plans.append(inference.plan(identify({}, body), body, f"r{i}", BASE).plan)
    assert all(p.agent_id and p.agent_id.startswith("agent-") for p in plans)
    assert [p.adapter for p in plans] == [ref("critic"), ref(None), ref("critic")]
    assert Inference(InferenceSettings()).plan(identify({}, body), body, "r", BASE).plan.adapter == ref(None)


def test_a_session_leaves_a_home_that_does_not_serve_its_adapter():
    """Affinity is by session, whatever the adapter; but an upstream must serve the exact
    `base:adapter`, so a home without it loses the session (to one that has it)."""
    pool = UpstreamPool(["http://a", "http://b"], Breaker(), 2.0)
    a, b = pool.upstreams
    a.models, b.models = frozenset({BASE, f"{BASE}:math"}), frozenset(SERVED)
    assert pool.candidates(f"{BASE}:math", "s")[0] is a
    assert pool.candidates(BASE, "s")[0] is a
    assert [u.url for u in pool.candidates(f"{BASE}:code", "s")] == ["http://b"]
    assert pool.candidates(f"{BASE}:math", "s")[0] is b  # the session now lives on b


# -- through the gateway ---------------------------------------------------------------------
CRITIC_RULES = {"rules": [{"agent": "critic*", "adapter": "critic"}]}


def chat(system: str = CRITIC_SYSTEM, model: str = BASE) -> dict:
    return {"model": model, "messages": [{"role": "system", "content": system},
                                         {"role": "user", "content": "Is 2 + 2 = 5?"}]}


def test_a_rule_routes_an_agent_to_its_adapter_end_to_end(fake_upstream, start_gateway):
    fake = fake_upstream(models=SERVED)
    gw = start_gateway([fake.url], adapters=CRITIC_RULES)
    with gw.client() as http:
        r = http.post("/v1/chat/completions", json=chat(), headers={"x-kvrelay-agent-id": "critic-1"})
        assert r.status_code == 200, r.text
        body = fake.received[-1].body
        assert body["model"] == f"{BASE}:critic"
        assert body["kv_transfer_params"]["kvrelay"]["adapter"] == {"base": BASE, "name": "critic"}
        assert read_plan(body).adapter == ref("critic")
        # routing is not reuse: with the plan switched off the adapter still applies
        r = http.post("/v1/chat/completions", json=chat(),
                      headers={"x-kvrelay-agent-id": "critic-2", "x-kvrelay-reuse": "off"})
        assert r.status_code == 200, r.text
        assert fake.received[-1].body["model"] == f"{BASE}:critic"
        assert read_plan(fake.received[-1].body).segments == []  # a plan naming the tenant, nothing to reuse
        # another agent runs on the base; a client's own adapter is kept
        http.post("/v1/chat/completions", json=chat(PLANNER_SYSTEM), headers={"x-kvrelay-agent-id": "planner"})
        http.post("/v1/chat/completions", json=chat(model=f"{BASE}:math"), headers={"x-kvrelay-agent-id": "critic-3"})
    assert [rec.body["model"] for rec in fake.received[2:]] == [BASE, f"{BASE}:math"]
    rows = gw.rows(4)
    assert [(row.agent_id, row.model) for row in rows] == [
        ("critic-1", f"{BASE}:critic"), ("critic-2", f"{BASE}:critic"), ("planner", BASE), ("critic-3", f"{BASE}:math")]


def test_a_system_rule_routes_an_unmodified_app_end_to_end(fake_upstream, start_gateway):
    fake = fake_upstream(models=SERVED)
    gw = start_gateway([fake.url], adapters={"rules": [{"system": r"^You are the Critic\b", "adapter": "critic"}]})
    with gw.client() as http:
        for system in (CRITIC_SYSTEM, PLANNER_SYSTEM):
            assert http.post("/v1/chat/completions", json=chat(system)).status_code == 200
    assert [rec.body["model"] for rec in fake.received] == [f"{BASE}:critic", BASE]


def test_all_adapters_of_a_session_land_on_its_upstream(fake_upstream, start_gateway):
    """ICaRus: every adapter of a base reads the session's one KV cache, so a session's
    requests stay on its home upstream whichever adapter each is routed to, even when
    load alone would send the next one elsewhere."""
    f0, f1 = fake_upstream(models=SERVED), fake_upstream(models=SERVED)
    gw = start_gateway([f0.url, f1.url], adapters={"rules": [
        {"agent": "critic*", "adapter": "critic"}, {"agent": "solver*", "adapter": "math"}]})
    u0, u1 = gw.pool.upstreams
    session = {"x-kvrelay-session-id": "icarus-1"}
    with httpx.Client(base_url=gw.url, timeout=30) as http:
        assert http.post("/v1/chat/completions", json=chat(PLANNER_SYSTEM),
                         headers={**session, "x-kvrelay-agent-id": "solver-1"}).status_code == 200
        home, other = (u0, u1) if f0.received else (u1, u0)
        home.in_flight += 1  # someone else's request runs at home: by load alone, the next goes elsewhere
        try:
            assert http.post("/v1/chat/completions", json=chat(),
                             headers={**session, "x-kvrelay-agent-id": "critic-1"}).status_code == 200
            assert http.post("/v1/chat/completions", json=chat(),
                             headers={"x-kvrelay-session-id": "another", "x-kvrelay-agent-id": "critic-1"}
                             ).status_code == 200
        finally:
            home.in_flight -= 1
    rows = {(row.session_id, row.model): row.upstream for row in gw.rows(3)}
    assert rows == {("icarus-1", f"{BASE}:math"): home.url, ("icarus-1", f"{BASE}:critic"): home.url,
                    ("another", f"{BASE}:critic"): other.url}
    plans = [read_plan(rec.body) for rec in (f0.received + f1.received)]
    assert {p.adapter.base for p in plans if p is not None and p.adapter is not None} == {BASE}
