"""The kvrelay connector inside real vLLM replicas: a fixed prefix that vLLM's own cache
lost is loaded from the connector's tiers (cached tokens prove it, the answer matches a
recomputed one), a damaged block file is recomputed, the agent due next keeps its prefix
in vLLM's own cache where vLLM's LRU gives it up, and the gateway's own plans drive it
end to end. Each replica's KV cache holds 24 blocks; two long prompts push older blocks
out (as agents' fixed prefixes, which the connector keeps behind every plain block)."""

from __future__ import annotations

import hashlib
import re
import time

import httpx
import openai
import pytest

from kvrelay.wire.plan import PLAN_KEY, Segment, SegmentPlan, WorkflowInfo
from tests.gateway.vllm.conftest import MODEL, VLLM_BLOCK, VLLM_TIMEOUTS

# About 430 tokens with the chat template: 3 whole vLLM blocks inside the system prompt.
SYSTEM = "You are the archivist of a merchant guild. File each ledger under its year and trade. " * 22
GEN = {"max_tokens": 12, "temperature": 0}


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _plan(system: str, question: str, agent: str = "archivist", steps: dict[str, int] | None = None) -> dict:
    """The plan the gateway sends once it has learned the agent's fixed prefix."""
    workflow = WorkflowInfo(steps_to_execution=steps, next=[]) if steps else None
    plan = SegmentPlan(session_id="direct", agent_id=agent, request_id=f"r{time.monotonic_ns()}", app_id="tests",
                       workflow=workflow, segments=[Segment(message_index=0, char_start=0, char_end=len(system), kind="fixed_prefix",
                                         name=agent, content_hash=_sha(system)),
                                 Segment(message_index=1, char_start=0, char_end=len(question), kind="private",
                                         content_hash=_sha(question))])
    return {PLAN_KEY: plan.model_dump(mode="json")}


def _ask(client: openai.OpenAI, system: str | None, question: str, plan: bool, agent: str = "archivist",
         steps: dict[str, int] | None = None):
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    extra = {"kv_transfer_params": _plan(system, question, agent, steps)} if plan and system else {}
    return client.chat.completions.create(model=MODEL, messages=messages, extra_body=extra, **GEN)


def _push_out(client: openai.OpenAI, tag: str, as_agents: bool = True) -> None:
    """Two ~1650-token prompts (28 blocks, more than the cache's 24): vLLM evicts the older
    blocks. As agents' fixed prefixes (the default) they outrank every older prefix whose
    agent has no next step, so even the connector's KVFlow order gives those up."""
    for k in range(2):
        filler = " ".join(f"Note {i} of batch {tag}{k}: the {tag} market of town {i} sold grain." for i in range(75))
        if as_agents:
            _ask(client, filler, "Summarise.", plan=True, agent=f"filler-{tag}{k}")
        else:
            _ask(client, None, filler, plan=False)


def _cached(response) -> int:
    return response.usage.prompt_tokens_details.cached_tokens


def _device_hits(replica) -> float:
    """Prompt tokens vLLM has served from its own device cache so far (its /metrics)."""
    text = httpx.get(f"{replica.url}/metrics", timeout=10).text
    found = re.search(r'^vllm:prompt_tokens_cached_by_source_total\{[^}]*source="device"[^}]*\} (\S+)$', text, re.M)
    assert found, "vLLM's /metrics has no device cache-hit counter"
    return float(found.group(1))


def _block_files(directory) -> set:
    return {p for p in directory.iterdir() if not p.name.startswith(".")} if directory.exists() else set()


def _wait_for_new_files(directory, before: set, num: int, timeout_s: float = 10.0) -> set:
    """The block files that appeared since `before`, once there are `num` (saves are written in the background)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        new = _block_files(directory) - before
        if len(new) >= num:
            return new
        time.sleep(0.1)
    raise AssertionError(f"{directory} gained fewer than {num} block files")


@pytest.fixture
def replica(vllm_replicas):
    return vllm_replicas[0]


@pytest.fixture
def client(replica):
    with openai.OpenAI(base_url=f"{replica.url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def test_a_prefix_vllm_evicted_is_loaded_from_the_host_tier(client, replica):
    before = _block_files(replica.host_dir)
    first = _ask(client, SYSTEM, "Where does the salt ledger go?", plan=True)
    assert _cached(first) == 0
    time.sleep(0.5)
    assert len(_wait_for_new_files(replica.host_dir, before, 3)) == 3  # the prefix's 3 whole blocks, nothing else
    _push_out(client, "a")
    loaded = _ask(client, SYSTEM, "And the iron ledger?", plan=True)
    assert _cached(loaded) == 3 * VLLM_BLOCK
    _push_out(client, "b")
    recomputed = _ask(client, SYSTEM, "And the iron ledger?", plan=False)
    assert _cached(recomputed) == 0  # vLLM itself had lost the prefix: the hit above was the connector's
    assert loaded.choices[0].message.content == recomputed.choices[0].message.content


def test_a_damaged_block_file_is_recomputed_not_trusted(client, replica):
    system = SYSTEM.replace("archivist", "treasurer")
    before = _block_files(replica.host_dir)
    reference = _ask(client, system, "Which ledger is oldest?", plan=True)
    saved = _wait_for_new_files(replica.host_dir, before, 3)
    for path in saved:
        path.write_bytes(path.read_bytes()[:1000])  # cut short: every block of this prefix
    warnings = replica.log_tail(10**7).count("recomputing a block")
    _push_out(client, "c")
    again = _ask(client, system, "Which ledger is oldest?", plan=True)
    assert again.choices[0].message.content == reference.choices[0].message.content
    assert replica.log_tail(10**7).count("recomputing a block") > warnings
    deadline = time.monotonic() + 10
    while any(p.exists() for p in saved) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(p.exists() for p in saved)  # the damaged files are deleted, not kept


def test_the_gateway_s_plans_drive_the_connector(vllm_replicas, start_gateway):
    gw = start_gateway([r.url for r in vllm_replicas], timeouts=VLLM_TIMEOUTS)
    system = SYSTEM.replace("archivist", "auditor")
    headers = {"x-kvrelay-session-id": "audit"}
    before = {r.url: _block_files(r.host_dir) for r in vllm_replicas}
    with openai.OpenAI(base_url=gw.v1, api_key="unused", max_retries=0, timeout=120, default_headers=headers) as c:
        for question in ("First audit?", "Second audit?", "Third audit?"):  # the gateway learns the fixed prefix
            c.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": system},
                                                             {"role": "user", "content": question}], **GEN)
        rows = gw.rows(3)
        home = next(r for r in vllm_replicas if r.url == rows[0].upstream)
        assert '"fixed_prefix"' in rows[-1].plan
        assert len(_wait_for_new_files(home.host_dir, before[home.url], 3)) == 3  # kept once a plan named it
        with openai.OpenAI(base_url=f"{home.url}/v1", api_key="unused", max_retries=0, timeout=120) as direct:
            _push_out(direct, "d")
        last = c.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": system},
                                                                {"role": "user", "content": "Fourth audit?"}], **GEN)
    assert _cached(last) >= 3 * VLLM_BLOCK
    assert gw.rows(4)[-1].upstream == home.url and gw.rows(4)[-1].cached_tokens == _cached(last)
    # After the same push-out vLLM alone has nothing cached (the first test shows it): the hit is the connector's.


def test_the_agent_due_next_keeps_its_prefix_in_vllm_s_own_cache(client, replica):
    """KVFlow over vLLM's free queue: after A and then B ran, with A due next, two plain
    prompts push 26 blocks through the 23 free ones. vLLM's LRU gives up A's prefix first
    (the control, without plans); with plans A's blocks stay on the device."""
    for planned in (False, True):
        tag = "planned" if planned else "plain"
        systems = {name: SYSTEM.replace("archivist", f"{name} {tag}") for name in ("scribe", "clerk")}
        _ask(client, systems["scribe"], "Which ledger first?", planned, "scribe", {"scribe": 0, "clerk": 1})
        _ask(client, systems["clerk"], "Which ledger next?", planned, "clerk", {"clerk": 0, "scribe": 1})
        _push_out(client, f"{tag}-dev", as_agents=False)
        before = _device_hits(replica)
        again = _ask(client, systems["scribe"], "Which ledger now?", planned, "scribe", {"scribe": 0, "clerk": 1})
        from_device = _device_hits(replica) - before
        if planned:
            assert _cached(again) >= 3 * VLLM_BLOCK and from_device >= 3 * VLLM_BLOCK
        else:
            assert from_device == 0  # vLLM alone evicted the prefix


def test_tenants_share_no_cached_kv_on_vllm_and_the_tiers_serve_salted_requests(replica, start_gateway):
    """The gateway salts each tenant's requests: on one replica, tenant B gets nothing of
    A's prompt from vLLM's own cache, and the connector still keeps and loads A's prefix."""
    gw = start_gateway([replica.url], timeouts=VLLM_TIMEOUTS)  # one replica: both tenants' requests meet on it
    system = SYSTEM.replace("archivist", "notary")

    def ask(app: str, question: str):
        with openai.OpenAI(base_url=gw.v1, api_key="unused", max_retries=0, timeout=120,
                           default_headers={"x-kvrelay-app": app, "x-kvrelay-session-id": f"{app}-deeds"}) as c:
            return c.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": system},
                                                                    {"role": "user", "content": question}], **GEN)

    before = _block_files(replica.host_dir)
    a = [ask("tenant-a", q) for q in ("First deed?", "Second deed?", "Third deed?")]  # the gateway learns the prefix
    assert _cached(a[0]) == 0 and _cached(a[1]) >= 3 * VLLM_BLOCK  # the control: a tenant hits its own prompt
    b = ask("tenant-b", "First deed?")  # A's first prompt, token for token
    assert _cached(b) == 0
    assert len(_wait_for_new_files(replica.host_dir, before, 3)) >= 3  # A's salted prefix is kept in the tiers
    with openai.OpenAI(base_url=f"{replica.url}/v1", api_key="unused", max_retries=0, timeout=120) as direct:
        _push_out(direct, "salt")
    assert _cached(ask("tenant-a", "Fourth deed?")) >= 3 * VLLM_BLOCK  # loaded by the connector: vLLM lost it
    assert _cached(ask("tenant-b", "Second deed?")) == 0
