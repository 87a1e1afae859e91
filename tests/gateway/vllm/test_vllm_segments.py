"""Approximate segment reuse inside a real vLLM replica, for plans that opt in: an agent's
answer is kept (from its own request's blocks when the model tokenized it as a prompt
would, else from the first prompt that quotes it) and placed (RoPE-shifted, the text
around it computed by kvrelay's model) in the prompts after that. The
replicas run blend with blend_ratio 1, which recomputes every placed token: the answer
must then be vLLM's own, which holds the whole path (claim, vLLM's cache layout, the
computation, the write-back) to vLLM's numbers. Shift places the KV as it is. Either way
the blocks from the first placed token on stay out of vLLM's prefix cache."""

from __future__ import annotations

import hashlib
import time

import openai
import pytest

from kvrelay.wire.plan import PLAN_KEY, Segment, SegmentPlan
from tests.gateway.vllm.conftest import MODEL, VLLM_BLOCK

QUESTION = "Which ledgers should the guild keep for the spice trade this year, and why?"
ROLE = "You are {name}, a clerk of the merchant guild. " + "Keep answers to the point and cite the ledgers. " * 14
FILLER = "The guild's older ledgers are kept in the east hall, sorted by year and trade. " * 12


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _messages(name: str, quotes: list[tuple[str, str]]) -> list[dict]:
    return ([{"role": "system", "content": ROLE.format(name=name)}, {"role": "user", "content": QUESTION}]
            + [{"role": "user", "name": who, "content": text} for who, text in quotes])


def _plan(name: str, messages: list[dict], method: str) -> dict:
    """The gateway's plan for an app opted into `method`: the role prompt, the question and each quote."""
    segments = [Segment(message_index=0, char_start=0, char_end=len(messages[0]["content"]), kind="fixed_prefix",
                        name=name, content_hash=_sha(messages[0]["content"]), method=method),
                Segment(message_index=1, char_start=0, char_end=len(QUESTION), kind="private",
                        content_hash=_sha(QUESTION), method=method)]
    segments += [Segment(message_index=i, char_start=0, char_end=len(m["content"]), kind="placeholder",
                         name=f"agent_{m['name']}_current", content_hash=_sha(m["content"]), method=method)
                 for i, m in enumerate(messages) if i >= 2]
    plan = SegmentPlan(session_id=f"team-{method}", agent_id=name, request_id=f"r{time.monotonic_ns()}",
                       app_id="team", segments=segments)
    return {PLAN_KEY: plan.model_dump(mode="json")}


def _ask(client: openai.OpenAI, messages: list[dict], plan: dict | None, max_tokens: int = 16, min_tokens: int = 0):
    extra: dict = {"kv_transfer_params": plan} if plan else {}
    if min_tokens:
        extra["min_tokens"] = min_tokens
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0,
                                          logprobs=True, extra_body=extra)


@pytest.fixture
def replica(vllm_replicas):
    """A replica still running (test_vllm_gateway's failover test kills one of the two)."""
    return next(r for r in vllm_replicas if r.process is not None and r.process.poll() is None)


@pytest.fixture
def client(replica):
    with openai.OpenAI(base_url=f"{replica.url}/v1", api_key="unused", max_retries=0, timeout=180) as c:
        yield c


@pytest.mark.parametrize("method", ["blend", "shift"])
def test_a_quoted_answer_is_kept_then_placed(client, replica, method):
    names = [f"{who}-{method}" for who in ("ada", "bo", "cy")]
    for name in names:  # role prompt and question into vLLM's cache, as an app's earlier rounds would
        _ask(client, _messages(name, [("earlier", FILLER)]), None, max_tokens=1)
    # An answer longer than a vLLM block: it outnumbers whatever lies between vLLM's cached
    # blocks and the quote, so placing it computes fewer tokens and the connector claims it.
    first = _ask(client, _messages(names[0], []), _plan(names[0], _messages(names[0], []), method),
                 max_tokens=VLLM_BLOCK + 16, min_tokens=VLLM_BLOCK + 16)
    quotes = [(names[0], first.choices[0].message.content)]
    _ask(client, _messages(names[1], quotes), _plan(names[1], _messages(names[1], quotes), method))
    messages = _messages(names[2], quotes)
    placed = _ask(client, messages, _plan(names[2], messages, method))
    dense = _ask(client, messages, None)  # vLLM alone, the same prompt
    role_cached = dense.usage.prompt_tokens_details.cached_tokens  # what vLLM holds: role and question
    assert role_cached >= VLLM_BLOCK
    claim_end = placed.usage.prompt_tokens_details.cached_tokens
    assert claim_end > role_cached + 32  # the claim reached the end of the quote
    # vLLM alone found only exact blocks: none from the block the quote starts in.
    quote_start = claim_end - first.usage.completion_tokens - 1  # give or take a token of tokenization
    assert role_cached <= quote_start // VLLM_BLOCK * VLLM_BLOCK
    log = replica.log_tail(10**7)
    assert "differs from kvrelay's model" not in log and "blocks itself after" not in log  # no claim fell back
    if method == "blend":  # every placed token recomputed: vLLM's own answer
        assert placed.choices[0].message.content == dense.choices[0].message.content
    else:
        assert placed.choices[0].message.content



def test_the_gateway_scores_its_blend_probes_on_vllm(replica, start_gateway):
    """The product path: a gateway rule opts the app into blend, the guard probes every
    request, and since vLLM cannot score probes the gateway scores them itself on the
    replica's idle time. The replicas run blend at ratio 1, so the figures must be exact."""
    from kvrelay.gateway.approximation import ApproximationSettings, GuardSettings
    from tests.gateway.vllm.conftest import VLLM_TIMEOUTS

    approximation = ApproximationSettings(rules=[{"method": "blend"}],
                                          guard=GuardSettings(sample_rate=1.0, poll_interval_s=0.2))
    # One gateway, one replica on one core: a health check (bounded by connect_s) must not
    # time out while the replica scores a probe, or the next request finds no upstream.
    timeouts = VLLM_TIMEOUTS.model_copy(update={"connect_s": 30.0})
    gw = start_gateway([replica.url], timeouts=timeouts, approximation=approximation, health_interval_s=1.0)
    headers = {"x-kvrelay-session-id": "guarded"}
    with openai.OpenAI(base_url=gw.v1, api_key="unused", max_retries=0, timeout=180, default_headers=headers) as c:
        time.sleep(1.0)  # the poller has asked the replica for its scores once (it has none: 404)
        for question in ("Which ledger first?", "Which ledger next?"):
            c.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": ROLE.format(name="vera")},
                                                             {"role": "user", "content": question}],
                                      max_tokens=8, temperature=0)
    deadline = time.monotonic() + 120
    guard = gw.state.fidelity
    while time.monotonic() < deadline and gw.state.prober.num_scored < 2:
        time.sleep(0.5)
    assert gw.state.prober.num_scored == 2 and gw.state.prober.num_failed == 0
    row, = [r for r in guard.snapshot() if r["method"] == "blend"]
    assert row["scores"] == 2 and row["state"] == "on"
    assert row["top1"] == 1.0 and row["kl"] < 1e-3
