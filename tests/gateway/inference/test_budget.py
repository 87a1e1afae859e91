"""The planning budget: once `plan_budget_ms` is spent, the stages of the plan not yet
begun are skipped and the request goes on with what was planned (its tenant always),
counted as plans_over_budget; through the gateway, the upstream gets that plan."""

from __future__ import annotations

import gc
import re
import time

from kvrelay.wire.plan import read_plan
from kvrelay.gateway.identity import identify
from kvrelay.gateway.inference import Inference, planner
from kvrelay.gateway.inference.budget import Deadline
from kvrelay.gateway.settings import InferenceSettings

SYSTEM = "You are the archivist of the harbour office. Answer from the ledgers."
LEDGER = "The ledger of the third quarter lists forty ships and their cargo of grain."


def _plan(inference: Inference, user: str, request_id: str = "r"):
    body = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]}
    return inference.plan(identify({"x-session-id": "s", "x-kvrelay-app": "harbour"}, body, None), body,
                          request_id, "m")


class _ExpiresAfter(Deadline):
    """A deadline that passes after `checks` looks at it: no clock in the test."""

    def __init__(self, checks: int) -> None:
        super().__init__(0.0)
        self.checks = checks

    def expired(self) -> bool:
        self.checks -= 1
        return self.checks < 0


def test_a_plan_over_budget_is_forwarded_with_its_tenant_only_and_counted(monkeypatch):
    monkeypatch.setattr(planner, "PER_MESSAGE_MS", 0.0)
    inference = Inference(InferenceSettings(plan_budget_ms=1e-6))  # spent before the segments begin
    result = _plan(inference, LEDGER)
    assert result.over_budget and inference.bounded["plans_over_budget"] == 1
    plan = result.plan
    assert plan.segments == [] and plan.round is None and plan.workflow is None
    assert plan.tenant is not None and plan.agent_id == result.agent_id and plan.session_id == "s"
    assert inference.apps["harbour"].sessions["s"].last_agent == result.agent_id  # the next run still follows it


def test_a_budget_spent_after_the_segments_keeps_them_and_drops_the_workflow(monkeypatch):
    inference = Inference(InferenceSettings())
    # Looked at before the segments (in time), then before the step graph (spent); the
    # message has no blocks, so nothing looks in between.
    monkeypatch.setattr(planner, "Deadline", lambda budget_s: _ExpiresAfter(1))
    result = _plan(inference, LEDGER)
    assert result.over_budget and inference.bounded["plans_over_budget"] == 1
    assert result.plan.segments and result.plan.workflow is None


def test_the_budget_grows_with_the_transcript(monkeypatch):
    """Planning is linear in the messages: a long transcript gets a budget in proportion."""
    budgets = []
    monkeypatch.setattr(planner, "Deadline", lambda budget_s: budgets.append(budget_s) or Deadline(budget_s))
    inference = Inference(InferenceSettings(plan_budget_ms=10))
    _plan(inference, LEDGER)
    body = {"messages": [{"role": "user", "content": f"turn {i}"} for i in range(1000)]}
    inference.plan(identify({"x-session-id": "long"}, body, None), body, "r-long", "m")
    assert budgets == [(10 + 2 * planner.PER_MESSAGE_MS) / 1e3, (10 + 1000 * planner.PER_MESSAGE_MS) / 1e3]


def test_the_scan_for_known_texts_is_not_counted(monkeypatch):
    """The scan is linear and done whatever the budget; a slow one (the first long prompt
    after start touches fresh memory) must not cost the plan its segments."""
    scan = planner.find_texts

    def slow_scan(app, content):
        spent = time.thread_time() + 0.02  # twice the budget, in the clock the budget counts
        while time.thread_time() < spent:
            pass
        return scan(app, content)

    monkeypatch.setattr(planner, "find_texts", slow_scan)
    inference = Inference(InferenceSettings(plan_budget_ms=10))
    result = _plan(inference, LEDGER)
    assert not result.over_budget and result.plan.segments and result.plan.workflow is not None


def test_a_collector_pause_is_not_counted(monkeypatch):
    """A full collection walks every object of the process, on the thread that happens
    to allocate: it is not the plan's work, and must not cut the plan it interrupts."""
    garbage = [[] for _ in range(1_000_000)]  # a heap with a million containers to walk
    ids = planner.call_ids
    spent = []

    def collect_then_ids(body):  # called once the plan's clock runs
        started = time.thread_time()
        gc.collect()
        spent.append(time.thread_time() - started)
        return ids(body)

    monkeypatch.setattr(planner, "PER_MESSAGE_MS", 0.0)
    monkeypatch.setattr(planner, "call_ids", collect_then_ids)
    inference = Inference(InferenceSettings(plan_budget_ms=5))
    result = _plan(inference, LEDGER)
    assert spent[0] > 0.005 and garbage  # the collection took longer than the whole budget
    assert not result.over_budget and result.plan.segments and result.plan.workflow is not None


def test_a_plan_within_budget_is_whole_and_not_counted():
    inference = Inference(InferenceSettings())
    result = _plan(inference, LEDGER)
    assert not result.over_budget and "plans_over_budget" not in inference.bounded
    assert result.plan.segments and result.plan.workflow is not None


def test_through_the_gateway_the_upstream_gets_the_tenant_only_plan_and_metrics_count_it(
        fake_upstream, start_gateway, monkeypatch):
    monkeypatch.setattr(planner, "PER_MESSAGE_MS", 0.0)
    fake = fake_upstream()
    gw = start_gateway([fake.url], inference={"plan_budget_ms": 1e-6})
    chat = {"model": "fake", "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": LEDGER}]}
    with gw.client() as http:
        assert http.post("/v1/chat/completions", json=chat).status_code == 200
        text = http.get("/metrics").text
    plan = read_plan(fake.received[-1].body)
    assert plan is not None and plan.tenant is not None
    assert plan.segments == [] and plan.round is None and plan.workflow is None
    assert re.search(r'^kvrelay_state_bounded_total\{kind="plans_over_budget"\} 1\.0$', text, re.M)


def test_the_cpu_clock_is_read_only_once_the_wall_clock_has_run_the_budget(monkeypatch):
    """A thread's CPU time never runs ahead of the wall clock: before the budget's wall
    time has passed, expired() does not ask the CPU clock (a system call); after it,
    the CPU clock alone says whether the budget is spent."""
    deadline = Deadline(0.05, time.thread_time)
    reads: list[float] = []
    monkeypatch.setattr(deadline, "_clock", lambda: reads.append(now := time.thread_time()) or now)
    assert not deadline.expired() and reads == []
    time.sleep(0.06)  # the wall clock ran the budget; the thread's CPU time hardly moved
    assert not deadline.expired() and len(reads) == 1
    while time.thread_time() < deadline.at:  # spend the budget in CPU time
        pass
    assert deadline.expired()
    assert not Deadline(0.05, lambda: 0.0).expired()  # another clock is always read: no shortcut
    assert Deadline(0.0, lambda: 0.0).expired()
