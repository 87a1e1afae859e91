"""ConnectorPlanner with SmolLM2's tokenizer and a plan as the gateway writes it: prefix
blocks are saved once computed, later requests load what vLLM lost, requests without a
plan are left alone, failed loads are forgotten, and the agents due next are prefetched."""

from __future__ import annotations

import hashlib

import pytest
from transformers import AutoTokenizer

from engine_ext.kv.hashing import namespace_root
from kvrelay.wire.plan import PLAN_KEY, Segment, SegmentPlan, WorkflowInfo
from engine_ext.vllm.config import ConnectorConfig
from engine_ext.vllm.index import BlockMove, BlockSave
from engine_ext.vllm.locator import PrefixLocator
from engine_ext.vllm.planner import ConnectorPlanner, ScheduledBlocks

BLOCK = 16


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return AutoTokenizer.from_pretrained(smollm2_dir)


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def system(agent: str) -> str:
    return f"You are the {agent}. " + "Keep every ledger in order and answer briefly. " * 6


def request(tokenizer, agent: str, question: str, steps: dict[str, int] | None = None):
    """Token ids and kv_transfer_params of a chat request whose system prompt is fixed."""
    messages = [{"role": "system", "content": system(agent)}, {"role": "user", "content": question}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]  # as vLLM renders a chat request
    plan = SegmentPlan(
        session_id="s", agent_id=agent, request_id=f"{agent}-{question}", app_id="app",
        workflow=WorkflowInfo(steps_to_execution=steps, next=[]) if steps else None,
        segments=[Segment(message_index=0, char_start=0, char_end=len(system(agent)), kind="fixed_prefix",
                          name=agent, content_hash=sha(system(agent))),
                  Segment(message_index=1, char_start=0, char_end=len(question), kind="private",
                          content_hash=sha(question))])
    return list(ids), {PLAN_KEY: plan.model_dump(mode="json")}


def planner(tokenizer, num_host: int = 64, num_disk: int = 64, **config) -> ConnectorPlanner:
    cfg = ConnectorConfig(host_dir="/unused", disk_dir="/unused", **config)
    return ConnectorPlanner(cfg, BLOCK, namespace_root("test"), PrefixLocator(tokenizer), num_host, num_disk)


def run(p: ConnectorPlanner, rid: str, ids, params, num_local: int, first_block: int = 0):
    """One request through lookup, allocation and a step that computes all of it."""
    num_ext = p.num_matched_tokens(rid, ids, params, num_local)
    block_ids = list(range(first_block, first_block + len(ids) // BLOCK + 1))
    p.allocated(rid, block_ids, num_ext)
    plan = p.step([ScheduledBlocks(rid, block_ids, True, num_local + num_ext, len(ids) - num_local - num_ext)])
    p.finished(rid)
    return num_ext, plan


def test_locator_finds_the_fixed_prefix_in_the_chat_template(tokenizer):
    ids, params = request(tokenizer, "archivist", "Where is the salt ledger?")
    segment = SegmentPlan.model_validate(params[PLAN_KEY]).segments[0]
    locator = PrefixLocator(tokenizer)
    num = locator.num_prefix_blocks(ids, segment, BLOCK)
    inside, past = tokenizer.decode(ids[:num * BLOCK]), tokenizer.decode(ids[:(num + 1) * BLOCK])
    prompt = tokenizer.decode(ids)
    end = prompt.index(system("archivist")) + len(system("archivist"))
    assert num >= 3 and len(inside) <= end < len(past)
    assert locator.num_prefix_blocks(ids, segment.model_copy(update={"content_hash": "0" * 64}), BLOCK) == 0
    # The rest of the prompt tokenized apart (as a client sending token ids might) changes nothing.
    pieces = ids[:num * BLOCK + 5] + tokenizer(prompt[len(tokenizer.decode(ids[:num * BLOCK + 5])):],
                                                 add_special_tokens=False)["input_ids"]
    assert locator.num_prefix_blocks(pieces, segment, BLOCK) == num


def test_prefix_blocks_are_saved_then_loaded_when_vllm_lost_them(tokenizer):
    p = planner(tokenizer)
    ids, params = request(tokenizer, "archivist", "Where is the salt ledger?")
    num_ext, first = run(p, "r1", ids, params, 0)
    num_prefix = PrefixLocator(tokenizer).num_prefix_blocks(
        ids, SegmentPlan.model_validate(params[PLAN_KEY]).segments[0], BLOCK)
    assert num_ext == 0 and first.loads == []
    assert first.ops == [BlockSave(p.table._prefixes[("app", "archivist")][i], "host", i, "r1")
                         for i in range(num_prefix)]
    # A new question: vLLM kept one block itself; the tiers supply the rest of the prefix.
    ids2, params2 = request(tokenizer, "archivist", "And the iron ledger?")
    num_ext, second = run(p, "r2", ids2, params2, BLOCK, first_block=100)
    assert num_ext == (num_prefix - 1) * BLOCK
    assert [(load.tier, load.block_id) for load in second.loads] == [("host", 100 + i) for i in range(1, num_prefix)]
    assert second.ops == []  # nothing new to save
    assert p.stats.num_loaded_blocks == num_prefix - 1
    # vLLM still holds block 0 but the tiers lost it: blocks 1.. load all the same.
    p.index.drop(p.table._prefixes[("app", "archivist")][0])
    ids3, params3 = request(tokenizer, "archivist", "The wool ledger?")
    assert p.num_matched_tokens("r3", ids3, params3, BLOCK) == (num_prefix - 1) * BLOCK
    assert p.num_matched_tokens("r4", ids3, params3, 0) == 0


def test_requests_without_a_plan_are_left_to_vllm(tokenizer):
    p = planner(tokenizer)
    ids, params = request(tokenizer, "archivist", "Where is the salt ledger?")
    run(p, "r1", ids, params, 0)
    assert run(p, "r2", ids, None, 0)[0] == 0
    assert run(p, "r3", ids, {PLAN_KEY: {"version": 1, "nonsense": True}}, 0)[0] == 0
    assert p.stats.num_requests == 1


def test_the_last_prompt_token_is_never_supplied(tokenizer):
    p = planner(tokenizer)
    ids, params = request(tokenizer, "archivist", "Where is the salt ledger?")
    run(p, "r1", ids, params, 0)
    short = ids[:3 * BLOCK]  # ends exactly on a block boundary, inside the prefix
    assert p.num_matched_tokens("r2", short, params, 0) == 2 * BLOCK


def test_a_failed_load_drops_the_block_and_what_its_request_saved(tokenizer):
    p = planner(tokenizer)
    ids, params = request(tokenizer, "archivist", "Where is the salt ledger?")
    run(p, "r1", ids, params, 0)
    prefix = p.table._prefixes[("app", "archivist")]
    p.index.drop(prefix[-1])  # the last prefix block is gone: r2 loads the rest and computes it
    num_ext = p.num_matched_tokens("r2", ids, params, 0)
    block_ids = list(range(50, 50 + len(ids) // BLOCK + 1))
    p.allocated("r2", block_ids, num_ext)
    assert p.hit_sources("r2") == {"host": num_ext}
    plan = p.step([ScheduledBlocks("r2", block_ids, True, num_ext, len(ids) - num_ext)])
    assert [op.block_hash for op in plan.ops] == [prefix[-1]]  # recomputed, saved again
    p.load_failed({plan.loads[0].block_id})
    assert p.stats.num_failed_loads == 1
    assert p.index.where(prefix[0]) is None and p.index.where(prefix[-1]) is None
    deletes = p.step([]).ops
    assert {op.block_hash for op in deletes} == {prefix[0], prefix[-1]}
    assert all(isinstance(op, BlockMove) and op.target is None for op in deletes)
    assert p.num_matched_tokens("r2", ids, params, 0) == 0  # it saves and loads nothing more
    assert p.step([ScheduledBlocks("r2", None, False, len(ids), 1)]).ops == []


def test_chunked_prefill_saves_each_block_when_it_is_computed(tokenizer):
    p = planner(tokenizer)
    ids, params = request(tokenizer, "archivist", "Where is the salt ledger?")
    p.num_matched_tokens("r1", ids, params, 0)
    p.allocated("r1", [0, 1], 0)
    first = p.step([ScheduledBlocks("r1", [0, 1], True, 0, 2 * BLOCK + 3)])
    assert [op.block_id for op in first.ops] == [0, 1]
    rest = list(range(2, len(ids) // BLOCK + 1))
    second = p.step([ScheduledBlocks("r1", rest, False, 2 * BLOCK + 3, len(ids) - 2 * BLOCK - 3)])
    assert [op.block_id for op in second.ops] == rest[:len(p.table._prefixes[("app", "archivist")]) - 2]


def test_agents_due_next_move_from_disk_to_host(tokenizer):
    """A three-agent loop; the host holds 4 blocks, each prefix has 3. Once the scribe
    has run, the archivist is next (1 step): its prefix comes back from disk, displacing
    blocks of agents further away, and nothing of the clerk's moves up."""
    p = planner(tokenizer, num_host=5, num_disk=64, load_ahead=1)
    order = ["archivist", "clerk", "scribe"]
    for k, agent in enumerate(order):
        steps = {order[(k + j) % 3]: j for j in range(3)}
        ids, params = request(tokenizer, agent, "Begin.", steps)
        run(p, agent, ids, params, 0, first_block=20 * k)
    archivist = p.table._prefixes[("app", "archivist")]
    clerk = p.table._prefixes[("app", "clerk")]
    assert len(archivist) == 4 and any(p.index.where(b) == "disk" for b in archivist)
    plan = p.step([])
    promoted = [op.block_hash for op in plan.ops if isinstance(op, BlockMove) and op.target == "host"]
    assert promoted and set(promoted) <= set(archivist)
    assert all(p.index.where(b) == "host" for b in archivist)
    assert p.stats.num_promoted_blocks == len(promoted)
    assert p.step([]).ops == []  # settled: nothing more to move
    assert not set(clerk) & set(promoted)


def _as_tenant(params: dict, tenant: str) -> dict:
    return {PLAN_KEY: {**params[PLAN_KEY], "tenant": tenant}}


def test_the_tiers_keep_each_tenants_blocks_apart(tokenizer):
    p = planner(tokenizer)
    ids, params = request(tokenizer, "archivist", "Where is the salt ledger?")
    run(p, "r1", ids, _as_tenant(params, "team-a"), 0)
    ids2, params2 = request(tokenizer, "archivist", "And the iron ledger?")
    assert p.num_matched_tokens("b", ids2, _as_tenant(params2, "team-b"), BLOCK) == 0  # nothing of team-a's
    assert p.num_matched_tokens("a", ids2, _as_tenant(params2, "team-a"), BLOCK) > 0  # the control


def test_a_cache_salt_keeps_blocks_apart_within_a_tenant(tokenizer):
    p = planner(tokenizer)
    ids, params = request(tokenizer, "archivist", "Where is the salt ledger?")
    params = _as_tenant(params, "team-a")
    p.num_matched_tokens("r1", ids, params, 0, salt="user-1")
    block_ids = list(range(len(ids) // BLOCK + 1))
    p.allocated("r1", block_ids, 0)
    assert p.step([ScheduledBlocks("r1", block_ids, True, 0, len(ids))]).ops  # its prefix is saved
    p.finished("r1")
    ids2, params2 = request(tokenizer, "archivist", "And the iron ledger?")
    params2 = _as_tenant(params2, "team-a")
    assert p.num_matched_tokens("other-salt", ids2, params2, BLOCK, salt="user-2") == 0
    assert p.num_matched_tokens("no-salt", ids2, params2, BLOCK) == 0
    assert p.num_matched_tokens("same-salt", ids2, params2, BLOCK, salt="user-1") > 0  # the control


def test_with_a_seal_only_the_gateways_plans_are_followed(tokenizer):
    from kvrelay.wire.seal import SEAL_KEY, PlanSeal

    seal = PlanSeal("connector-secret-" + "c" * 16)
    cfg = ConnectorConfig(host_dir="/unused", disk_dir="/unused")
    p = ConnectorPlanner(cfg, BLOCK, namespace_root("test"), PrefixLocator(tokenizer), 64, 64, seal=seal)
    ids, params = request(tokenizer, "archivist", "Where is the salt ledger?")
    assert run(p, "forged", ids, params, 0)[1].ops == [] and p.stats.num_requests == 0  # unsealed: left to vLLM
    sealed = {**params, SEAL_KEY: seal.seal(params[PLAN_KEY])}
    assert run(p, "sealed", ids, sealed, 0)[1].ops != [] and p.stats.num_requests == 1
