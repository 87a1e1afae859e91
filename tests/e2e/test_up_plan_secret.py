"""`kvrelay up` with no plan secret configured still seals its plans: it generates one
for its gateway and engine, so a local process that sends the engine's port a plan
naming another tenant is not served from that tenant's cache."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from benchmarks.common import free_port
from benchmarks.stack import Service
from kvrelay.wire.plan import PLAN_KEY, SegmentPlan

VICTIM = "victim"
MESSAGES = [{"role": "user", "content": "The harbour ledger lists wool, salt and timber shipments for every "
                                        "month of the year, with the ship, its master and its cargo. " * 8
                                        + "\nWhich cargo came most often?"}]


class Up:
    def __init__(self, gateway: str, engine: str) -> None:
        self.gateway, self.engine = gateway, engine


@pytest.fixture(scope="module")
def up(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    folder = tmp_path_factory.mktemp("up-secret")
    engine_port = free_port()
    env = pytest.MonkeyPatch()
    env.delenv("KVRELAY_PLAN_SECRET", raising=False)  # none configured
    service = Service("up", ["up", "--model", str(smollm2_dir), "--served-model-name", "m",
                             "--engine-port", str(engine_port), "--log-level", "warning",
                             "--database-url", f"sqlite+aiosqlite:///{folder / 'x.sqlite'}"],
                      {}, folder)
    try:
        service.start(timeout=300)
        yield Up(service.url, f"http://127.0.0.1:{engine_port}")
    finally:
        service.stop()
        env.undo()


def _chat(url: str, extra: dict | None = None, headers: dict | None = None) -> dict:
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 1, "temperature": 0, **(extra or {})}
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def _cached(reply: dict) -> int:
    return int(((reply.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


@pytest.mark.slow
def test_an_unsealed_plan_naming_another_tenant_gets_no_hit_on_its_cache(up: Up) -> None:
    first = _chat(up.gateway, headers={"X-Kvrelay-App": VICTIM})
    again = _chat(up.gateway, headers={"X-Kvrelay-App": VICTIM})
    assert _cached(first) == 0 and _cached(again) > 100  # the control: the victim's own text is cached
    plan = SegmentPlan(session_id="s", agent_id="a", request_id="forged", segments=[], app_id=VICTIM,
                       tenant=f"app:{VICTIM}").model_dump(mode="json")
    forged = _chat(up.engine, {"kv_transfer_params": {PLAN_KEY: plan}})
    assert _cached(forged) == 0  # the plan was ignored: served as a plan-less request, from no tenant's cache
    ignored = [line for line in httpx.get(f"{up.engine}/metrics", timeout=30).text.splitlines()
               if line.startswith('kvrelay_engine_plans_ignored_total{reason="unsealed"}')]
    assert ignored and float(ignored[0].rsplit(" ", 1)[1]) == 1.0
