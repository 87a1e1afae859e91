"""Approximate segment reuse, scheduler side, with SmolLM2's tokenizer and plans as the
gateway writes them for an app that opted in: an answer is kept from the first prompt
that quotes it and placed in the next, the claim covers the prompt up to the last placed
segment, the blocks from there on leave vLLM's prefix cache, and nothing of this runs
for exact requests, other tenants, differently tokenized quotes or claims not worth it."""

from __future__ import annotations

import hashlib

import pytest
from transformers import AutoTokenizer

from engine_ext.kv.hashing import namespace_root
from engine_ext.vllm.config import ConnectorConfig
from engine_ext.vllm.locator import PrefixLocator
from engine_ext.vllm.planner import ConnectorPlanner, ScheduledBlocks
from engine_ext.vllm.segment_plan import SegmentDelete, SegmentPlanner, SegmentSave, SegmentSettings
from kvrelay.wire.plan import PLAN_KEY, Segment, SegmentPlan

BLOCK = 16
ANSWER = " The salt ledger goes under the year 1402, filed with the spice trade of the southern coast."
SYSTEM = "You are a clerk of the guild. Answer in one sentence. " * 3


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return AutoTokenizer.from_pretrained(smollm2_dir)


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


class Pool:
    """Records what the planner takes out of vLLM's prefix cache."""

    def __init__(self) -> None:
        self.evicted: set[int] = set()

    def get_cached_block(self, block_hash, kv_cache_group_ids):
        return None

    def evict_blocks(self, block_ids: set[int]) -> None:
        self.evicted |= block_ids


def quoting(tokenizer, agent: str, quote: str, method: str | None = "shift", tenant: str | None = None,
            between: str = "Agent A said:"):
    """A prompt whose user message quotes `quote` (a placeholder) after `between`."""
    user = f"{between}\n{quote.strip()}\nWhat do you add?"
    messages = [{"role": "system", "content": SYSTEM + agent}, {"role": "user", "content": user}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    start = user.index(quote.strip())
    plan = SegmentPlan(
        session_id="s", agent_id=agent, request_id=f"{agent}-{len(ids)}", app_id="team", tenant=tenant,
        segments=[Segment(message_index=0, char_start=0, char_end=len(SYSTEM + agent), kind="fixed_prefix",
                          name=agent, content_hash=sha(SYSTEM + agent), method=method),
                  Segment(message_index=1, char_start=start, char_end=start + len(quote.strip()),
                          kind="placeholder", name="agent_a_current", content_hash=sha(quote.strip()),
                          method=method)])
    return list(ids), {PLAN_KEY: plan.model_dump(mode="json")}


def planner(tokenizer, capacity: int = 10_000):
    cfg = ConnectorConfig(host_dir="/unused", disk_dir="/unused")
    segments = SegmentPlanner(tokenizer, namespace_root("test"), SegmentSettings(capacity))
    p = ConnectorPlanner(cfg, BLOCK, namespace_root("test"), PrefixLocator(tokenizer), 64, 64, segments=segments)
    pool = Pool()
    p.device.bind(pool)
    return p, pool


def answered(p: ConnectorPlanner, tokenizer, rid: str = "a", tenant: str = "team") -> None:
    """Agent A's request (opted in) finished with ANSWER and its stop token."""
    ids, params = quoting(tokenizer, "A", "nothing yet", tenant=None if tenant == "team" else tenant)
    p.num_matched_tokens(rid, ids, params, 0)
    p.finished(rid, tokenizer(ANSWER, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id])


def admit(p: ConnectorPlanner, rid: str, ids, params, num_local: int = 0):
    """Lookup, allocation and one step computing what is left; (claimed tokens, step plan)."""
    num_ext = p.num_matched_tokens(rid, ids, params, num_local)
    block_ids = list(range(100, 100 + len(ids) // BLOCK + 1))
    p.allocated(rid, block_ids, num_ext)
    done = num_local + num_ext
    return num_ext, p.step([ScheduledBlocks(rid, block_ids, True, done, len(ids) - done)])


def test_an_answer_is_kept_from_its_first_quote_and_placed_in_the_next(tokenizer):
    p, pool = planner(tokenizer)
    answered(p, tokenizer)
    ids_b, params_b = quoting(tokenizer, "B", ANSWER)
    claimed, step = admit(p, "b", ids_b, params_b, num_local=2 * BLOCK)
    assert claimed == 0 and not step.jobs  # nothing stored yet: vLLM computes it...
    saves = [op for op in step.ops if isinstance(op, SegmentSave)]
    assert len(saves) == 1  # ...and the connector keeps it
    answer_ids = tokenizer(ANSWER.strip(), add_special_tokens=False)["input_ids"]
    assert ids_b[saves[0].start:saves[0].end] == answer_ids
    ids_c, params_c = quoting(tokenizer, "C", ANSWER)
    claimed, step = admit(p, "c", ids_c, params_c, num_local=2 * BLOCK)
    (job, blocks), = step.jobs
    span, = job.spans
    assert ids_c[span.start:span.end] == answer_ids and span.position == saves[0].start
    assert claimed == span.end - 2 * BLOCK and job.num_computed == 2 * BLOCK and job.end == span.end
    assert job.token_ids == ids_c[:span.end] and job.blend_ratio == 0.0
    assert blocks == list(range(102, 100 + (span.end - 1) // BLOCK + 1))
    assert pool.evicted == set(range(100 + span.start // BLOCK, 100 + len(ids_c) // BLOCK + 1))


def test_blend_and_link_carry_their_settings(tokenizer):
    p, _ = planner(tokenizer)
    answered(p, tokenizer)
    admit(p, "b", *quoting(tokenizer, "B", ANSWER, method="blend"), num_local=2 * BLOCK)
    _, step = admit(p, "c", *quoting(tokenizer, "C", ANSWER, method="blend"), num_local=2 * BLOCK)
    assert step.jobs[0][0].blend_ratio == 0.15
    _, step = admit(p, "d", *quoting(tokenizer, "D", ANSWER, method="link"), num_local=3 * BLOCK)
    span = step.jobs[0][0].spans[0]
    assert span.skip == 8 and span.num_stored == span.end - span.start + 8


@pytest.mark.parametrize("case", ["exact", "kvcomm", "other tenant", "tokenized apart", "not worth it"])
def test_nothing_is_placed_where_it_should_not_be(tokenizer, case):
    p, pool = planner(tokenizer)
    answered(p, tokenizer)
    method = {"exact": None, "kvcomm": "kvcomm"}.get(case, "shift")
    tenant = "someone-else" if case == "other tenant" else None
    quote = ANSWER
    between = "Agent A said:"
    if case == "tokenized apart":
        between = "Agent A said:" + ANSWER[:9]  # the quote starts mid-sentence: " ledger ..." is not its own ids
        quote = ANSWER[9:]
    if case == "not worth it":
        between = "Background: " + "the guild keeps many ledgers of every kind. " * 12
    for rid in ("b", "c"):
        ids, params = quoting(tokenizer, rid, quote, method=method, tenant=tenant, between=between)
        claimed, step = admit(p, rid, ids, params, num_local=2 * BLOCK)
        assert claimed == 0 and not step.jobs
    assert not pool.evicted


def test_the_store_keeps_its_budget_and_a_failed_claim_drops_what_it_read(tokenizer):
    p, _ = planner(tokenizer, capacity=30)
    answered(p, tokenizer)
    admit(p, "b", *quoting(tokenizer, "B", ANSWER), num_local=2 * BLOCK)
    _, step = admit(p, "c", *quoting(tokenizer, "C", ANSWER), num_local=2 * BLOCK)
    (job, blocks), = step.jobs
    p.load_failed({blocks[0]})
    deletes = [op for op in p.step([]).ops if isinstance(op, SegmentDelete)]
    assert deletes == [SegmentDelete(job.spans[0].key)]
    _, step = admit(p, "d", *quoting(tokenizer, "D", ANSWER), num_local=2 * BLOCK)
    assert not step.jobs  # forgotten: the next quote keeps it again
    assert [op for op in step.ops if isinstance(op, SegmentSave)]
    segments = p.segments
    assert segments.saved(b"x" * 16, 0, 25) == [SegmentDelete(job.spans[0].key)]  # over 30 tokens: LRU goes


def test_a_finished_answer_is_kept_from_its_own_blocks_and_placed_by_the_next_prompt(tokenizer):
    p, _ = planner(tokenizer)
    ids_a, params_a = quoting(tokenizer, "A", "nothing yet")
    p.num_matched_tokens("a", ids_a, params_a, 0)
    answer = tokenizer(ANSWER.strip(), add_special_tokens=False)["input_ids"]
    blocks_a = list(range(40, 40 + (len(ids_a) + len(answer)) // BLOCK + 1))
    assert p.finished("a", answer, blocks_a)  # stopped by length: its last token has no KV
    save, = [op for op in p.step([]).ops if isinstance(op, SegmentSave)]
    assert save.hold and save.block_ids == blocks_a
    assert (save.start, save.end) == (len(ids_a), len(ids_a) + len(answer) - 1)
    ids_b, params_b = quoting(tokenizer, "B", ANSWER)
    claimed, step = admit(p, "b", ids_b, params_b, num_local=3 * BLOCK)
    span, = step.jobs[0][0].spans
    assert ids_b[span.start:span.end + 1] == answer and span.position == len(ids_a)
    assert claimed == span.end - 3 * BLOCK  # the answer's last token is computed with the rest
    ids_c, params_c = quoting(tokenizer, "C", "nothing yet")
    p.num_matched_tokens("c", ids_c, params_c, 0)
    assert not p.finished("c", tokenizer(ANSWER, add_special_tokens=False)["input_ids"][:2], [1])  # too short
    assert not p.finished("unknown", answer, [1])
