"""KVCOMM end to end through LLMEngine on a tiny 4-layer model: measuring, exact
reproduction, corrections per ablation mode, prediction, pruning and accounting, and
offsets never applied to another version (evicted and registered again) of their base."""

from __future__ import annotations

import math
import random

import pytest
import torch

from engine_ext.config import AnchorConfig, EngineConfig, ReuseConfig
from engine_ext.engine import LLMEngine
from engine_ext.kv.blobs import Blob
from engine_ext.reuse.segments import ReuseScope, TokenSegment
from engine_ext.sampling import SamplingParams
from tests.helpers import kv_bytes
from engine_ext.request import EngineRequest

ONE = SamplingParams(max_tokens=1, temperature=0.0)
SCOPE_A = ReuseScope("app", "agent-a")


@pytest.fixture(scope="module")
def deep_llama(tiny_model_dir):
    return tiny_model_dir("llama", num_hidden_layers=4)


def engine(model_dir, num_blocks=160, **anchors) -> LLMEngine:
    """Samples here are at most 32 tokens: one chunk each, unless a test sets `chunk_tokens`.
    Most tests exercise the paper's prediction from other samples' anchors
    (`new_samples="predict"`); the default, "readers", is tested at the end."""
    anchors.setdefault("chunk_tokens", 32)
    anchors.setdefault("new_samples", "predict")
    reuse = ReuseConfig(default_method="kvcomm", min_segment_tokens=4, anchors=AnchorConfig(**anchors))
    return LLMEngine(model_dir, EngineConfig(kv_cache_bytes=2 * kv_bytes(num_blocks), reuse=reuse))


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 200) for _ in range(n)]


class Agent:
    """A prompt layout: system | placeholder | 2 template tokens | fixed instruction | tail."""

    def __init__(self, seed: int) -> None:
        self.system, self.instruction, self.tail = tokens(19, seed), tokens(12, seed + 1), tokens(3, seed + 2)

    def prompt(self, sample: list[int]) -> tuple[list[int], list[TokenSegment]]:
        s, n = len(self.system), len(sample)
        f = s + n + 2
        ids = self.system + sample + [7, 8] + self.instruction + self.tail
        return ids, [TokenSegment(0, s, "fixed_prefix", "agent-a"),
                     TokenSegment(s, s + n, "placeholder", "user_question"),
                     TokenSegment(f, f + len(self.instruction), "fixed_prefix", "agent-a")]


def produce(eng: LLMEngine, sample: list[int], seed: int = 99) -> None:
    """The sample's base KV: computed behind another prompt and registered, as an agent's answer is."""
    prefix = tokens(11, seed)
    eng.generate(prefix + sample, ONE, segments=[TokenSegment(len(prefix), len(prefix) + len(sample),
                                                              "placeholder", "user_question")], publish=False)


def prefill_kv(eng: LLMEngine, ids, segments=None, scope=None):
    """Prefill one request and return (its K/V per layer at every prompt position, its seq)."""
    two = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)  # still running after the prefill
    seq = eng.add_request(EngineRequest(f"r{random.random()}", ids, two, segments=segments, publish=False, scope=scope))
    seq.logits = []
    while seq.num_computed_tokens < len(ids):
        eng.step()
    slots = eng.kv.slots(seq, len(ids))
    assert slots.shape == (len(ids),)
    kv = [(k[slots].clone(), v[slots].clone()) for k, v in eng.kv_cache.layers]
    eng.abort(seq.request_id)
    return kv, seq


def outcome_of(seq, kind_start: int):
    return next(o for o in seq.reuse_outcomes if o.segment.start == kind_start)


def test_first_sample_is_measured_then_its_exact_anchor_reproduces_the_real_kv(deep_llama):
    eng = engine(deep_llama)
    agent, sample, earlier = Agent(1), tokens(30, 2), tokens(26, 32)
    produce(eng, earlier)
    prefill_kv(eng, *agent.prompt(earlier), ReuseScope("app", None))  # the instruction's base, behind another text
    produce(eng, sample)
    ids, segs = agent.prompt(sample)
    dense_kv, dense_seq = prefill_kv(eng, ids)
    _, measured = prefill_kv(eng, ids, segs, SCOPE_A)
    first = outcome_of(measured, segs[1].start)
    assert first.method == "dense" and first.kvcomm["anchor"] == "new"
    assert eng.anchor_bank.stats()["anchors"] == 1

    kv, seq = prefill_kv(eng, ids, segs, SCOPE_A)
    ph, fixed = outcome_of(seq, segs[1].start), outcome_of(seq, segs[2].start)
    assert ph.method == "kvcomm" and ph.kvcomm["anchor"] == "exact" and ph.num_reused == len(sample)
    assert fixed.method == "kvcomm" and fixed.num_reused == len(agent.instruction)
    for (k, v), (dk, dv) in zip(kv, dense_kv):
        torch.testing.assert_close(k, dk, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(v, dv, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(seq.logits[0], dense_seq.logits[0], atol=1e-4, rtol=1e-4)
    # The system prompt at position 0 comes from the segment index too (shifted by 0: exact).
    assert seq.num_cached_tokens == len(agent.system) + len(sample) + len(agent.instruction)


@pytest.mark.parametrize("correction", ["rotation", "placeholder"])
def test_ablation_modes_leave_out_their_offsets(deep_llama, correction):
    eng = engine(deep_llama, correction=correction)
    agent, sample, earlier = Agent(3), tokens(30, 4), tokens(25, 34)
    produce(eng, earlier)
    # The instruction's base KV comes from behind another sample, as in a running workflow.
    prefill_kv(eng, *agent.prompt(earlier), ReuseScope("app", None))
    produce(eng, sample)
    ids, segs = agent.prompt(sample)
    dense_kv, _ = prefill_kv(eng, ids)
    prefill_kv(eng, ids, segs, SCOPE_A)  # measured
    kv, seq = prefill_kv(eng, ids, segs, SCOPE_A)
    ph = slice(segs[1].start, segs[1].end)
    fixed = slice(segs[2].start, segs[2].end)
    k_ph, k_fixed = kv[-1][0][ph], kv[-1][0][fixed]
    dense_ph, dense_fixed = dense_kv[-1][0][ph], dense_kv[-1][0][fixed]
    assert torch.allclose(k_ph, dense_ph, atol=2e-5) == (correction == "placeholder")
    assert not torch.allclose(k_fixed, dense_fixed, atol=2e-5)  # no prefix offset in either mode
    assert all(o.method == "kvcomm" for o in seq.reuse_outcomes if o.segment.start >= segs[1].start)
    # Layer 0 needs no correction: after the shift it is exact in every mode.
    torch.testing.assert_close(kv[0][0][ph], dense_kv[0][0][ph], atol=2e-5, rtol=1e-5)


def test_new_sample_is_predicted_from_the_anchors(deep_llama):
    eng = engine(deep_llama, gamma=1.0)
    agent = Agent(5)
    for n, seed in ((30, 6), (31, 7)):  # two anchors (the second is longer: no anchor serves it)
        sample = tokens(n, seed)
        produce(eng, sample)
        prefill_kv(eng, *agent.prompt(sample), SCOPE_A)
    assert eng.anchor_bank.stats()["anchors"] == 2
    new = tokens(24, 8)  # shorter than both: both are eligible
    produce(eng, new)
    ids, segs = agent.prompt(new)
    _, seq = prefill_kv(eng, ids, segs, SCOPE_A)
    ph = outcome_of(seq, segs[1].start)
    assert ph.method == "kvcomm" and ph.kvcomm["anchor"] == "hit" and ph.kvcomm["eligible"] == 2
    assert 1 <= ph.kvcomm["anchors_used"] <= 2 and ph.num_reused == len(new)
    assert outcome_of(seq, segs[2].start).method == "kvcomm"
    report = ph.to_json()
    assert report["kvcomm"]["anchor"] == "hit" and report["tokens_reused"] == len(new)
    used = sum(a.num_activations for pool in eng.anchor_bank.pools.values() for a in pool.anchors)
    assert used == ph.kvcomm["anchors_used"]


def test_longer_sample_than_every_anchor_becomes_an_anchor(deep_llama):
    eng = engine(deep_llama, gamma=1.0)
    agent = Agent(9)
    short = tokens(20, 10)
    produce(eng, short)
    prefill_kv(eng, *agent.prompt(short), SCOPE_A)
    longer = tokens(28, 11)
    produce(eng, longer)
    ids, segs = agent.prompt(longer)
    _, seq = prefill_kv(eng, ids, segs, SCOPE_A)
    ph = outcome_of(seq, segs[1].start)
    assert ph.method == "dense" and ph.kvcomm == {"anchor": "new", "anchors_used": 0, "eligible": 0}
    assert eng.anchor_bank.stats()["anchors"] == 2


def test_another_agent_measures_an_existing_anchor(deep_llama):
    eng = engine(deep_llama)
    a, b = Agent(12), Agent(13)
    sample = tokens(30, 14)
    produce(eng, sample)
    prefill_kv(eng, *a.prompt(sample), SCOPE_A)
    ids, segs = b.prompt(sample)
    _, seq = prefill_kv(eng, ids, segs, ReuseScope("app", "agent-b"))
    assert outcome_of(seq, segs[1].start).kvcomm["anchor"] == "measured"
    (anchor,) = eng.anchor_bank.pools[("default", "app", "user_question", 0)].anchors
    assert set(anchor.offsets) == {"agent-a", "agent-b"}
    # Other apps learn apart.
    _, other = prefill_kv(eng, ids, segs, ReuseScope("other-app", "agent-b"))
    assert outcome_of(other, segs[1].start).kvcomm["anchor"] == "new"


def test_without_an_agent_the_placeholder_is_only_shifted(deep_llama):
    eng = engine(deep_llama)
    sample = tokens(30, 15)
    produce(eng, sample)
    ids, segs = Agent(16).prompt(sample)
    _, seq = prefill_kv(eng, ids, segs, ReuseScope("app", None))
    assert outcome_of(seq, segs[1].start).method == "shift"
    assert eng.anchor_bank.stats()["anchors"] == 0


def test_pool_limit_prunes_and_frees_anchor_memory(deep_llama):
    eng = engine(deep_llama, max_anchors=2, prune_window=1, gamma=0.0, chunk_tokens=128)  # one chunk per sample
    agent = Agent(17)
    sizes = []
    for seed in range(20, 24):
        sample = tokens(30 + seed, seed)  # each longer than the last: always a new anchor
        produce(eng, sample)
        prefill_kv(eng, *agent.prompt(sample), SCOPE_A)
        stats = eng.anchor_bank.stats()
        sizes.append((stats["anchors"], stats["anchor_bytes"]))
    assert [n for n, _ in sizes] == [1, 2, 2, 2]
    pool = eng.anchor_bank.pools[("default", "app", "user_question", 0)]
    assert [len(a.token_ids) for a in pool.anchors] == [52, 53]
    bytes_per_block = eng.kv_cache.bytes_per_block
    expected = sum(len(b.blocks) for a in pool.anchors for b in a.blobs()) * bytes_per_block
    assert sizes[-1][1] == expected


def test_evicted_anchor_is_dropped_and_the_sample_measured_again(deep_llama):
    eng = engine(deep_llama, num_blocks=40)
    agent, sample = Agent(30), tokens(30, 31)
    produce(eng, sample)
    ids, segs = agent.prompt(sample)
    prefill_kv(eng, ids, segs, SCOPE_A)
    for seed in range(40, 46):  # fill the cache with other prompts: the LRU evicts the anchor
        eng.generate(tokens(150, seed), ONE)
    assert eng.anchor_bank.stats()["anchor_bytes"] == 0
    produce(eng, sample)
    _, seq = prefill_kv(eng, ids, segs, SCOPE_A)
    assert outcome_of(seq, segs[1].start).kvcomm["anchor"] == "new"


def evict_all_but(eng: LLMEngine, keep: list[Blob]) -> None:
    """The pool's LRU evicts every unpinned cached block (what a burst of other prompts
    does), sparing the blobs in `keep`."""
    index = eng.segment_index
    for blob in keep:
        index.blobs.acquire(blob)
    taken = index.pool.allocate(index.pool.num_free)
    index.pool.release(list(reversed(taken)))
    for blob in keep:
        index.blobs.release(blob)


def test_offsets_measured_against_an_evicted_base_are_never_applied_to_its_new_version(deep_llama):
    eng = engine(deep_llama)
    index, bank = eng.segment_index, eng.anchor_bank
    agent, sample, earlier = Agent(50), tokens(30, 51), tokens(26, 52)
    produce(eng, earlier)
    prefill_kv(eng, *agent.prompt(earlier), ReuseScope("app", None))  # the instruction's base
    produce(eng, sample)
    ids, segs = agent.prompt(sample)
    dense_kv, dense_seq = prefill_kv(eng, ids)
    prefill_kv(eng, ids, segs, SCOPE_A)  # measured
    _, seq = prefill_kv(eng, ids, segs, SCOPE_A)
    assert outcome_of(seq, segs[1].start).kvcomm["anchor"] == "exact"
    old = index.peek(sample)
    (stale,) = bank.pools[("default", "app", "user_question", 0)].anchors
    assert stale.base_identity.entry == old.identity
    # The sample's entry is evicted (its anchor and the instruction stay), then computed again
    # behind another prefix and registered: the same tokens, a new version, other KV.
    evict_all_but(eng, stale.blobs() + [index.peek(agent.instruction).blob])
    produce(eng, sample, seed=98)
    new = index.peek(sample)
    assert new.key == old.key and new.identity != old.identity
    v = eng.kv_cache.layers[-1][1]
    assert not torch.allclose(v[bank.blobs.slots(stale.base)], v[index.slots(new)], atol=1e-3)

    _, seq = prefill_kv(eng, ids, segs, SCOPE_A)
    ph = outcome_of(seq, segs[1].start)
    assert ph.method == "dense" and ph.num_reused == 0
    assert ph.kvcomm == {"anchor": "new", "anchors_used": 0, "eligible": 0, "stale_anchors": 1}
    assert ph.to_json()["kvcomm"]["stale_anchors"] == 1
    (fresh,) = bank.pools[("default", "app", "user_question", 0)].anchors
    assert fresh is not stale and fresh.base_identity.entry == new.identity and fresh.num_activations == 1

    # Measured again against the new version, the exact anchor reproduces the real KV again.
    kv, seq = prefill_kv(eng, ids, segs, SCOPE_A)
    ph, fixed = outcome_of(seq, segs[1].start), outcome_of(seq, segs[2].start)
    assert ph.method == "kvcomm" and ph.kvcomm == {"anchor": "exact", "anchors_used": 1}
    assert fixed.method == "kvcomm" and fixed.num_reused == len(agent.instruction)
    for (k, v), (dk, dv) in zip(kv, dense_kv):
        torch.testing.assert_close(k, dk, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(v, dv, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(seq.logits[0], dense_seq.logits[0], atol=1e-4, rtol=1e-4)


def test_prefix_offsets_of_a_reregistered_fixed_segment_are_refused_and_reported(deep_llama):
    eng = engine(deep_llama)
    index, bank = eng.segment_index, eng.anchor_bank
    agent, sample, earlier = Agent(60), tokens(30, 61), tokens(26, 62)
    produce(eng, earlier)
    prefill_kv(eng, *agent.prompt(earlier), ReuseScope("app", None))  # the instruction's base
    produce(eng, sample)
    ids, segs = agent.prompt(sample)
    prefill_kv(eng, ids, segs, SCOPE_A)  # measured
    (anchor,) = bank.pools[("default", "app", "user_question", 0)].anchors
    measured_against = anchor.offsets["agent-a"].prefix_base
    assert measured_against == index.peek(agent.instruction).identity
    # The instruction's entry is evicted; the next prompt computes it (no entry: no offset to
    # apply) and registers it again, behind this sample.
    evict_all_but(eng, anchor.blobs() + [index.peek(sample).blob])
    _, seq = prefill_kv(eng, ids, segs, SCOPE_A)
    assert outcome_of(seq, segs[1].start).kvcomm == {"anchor": "exact", "anchors_used": 1}
    assert outcome_of(seq, segs[2].start).reason == "kvcomm: no prefix offset measured for it"
    assert index.peek(agent.instruction).identity != measured_against
    # Now the index holds another version: the prefix offsets are refused, visibly.
    _, seq = prefill_kv(eng, ids, segs, SCOPE_A)
    ph, fixed = outcome_of(seq, segs[1].start), outcome_of(seq, segs[2].start)
    assert ph.method == "kvcomm" and ph.kvcomm == {"anchor": "exact", "anchors_used": 1, "stale_prefix_offsets": 1}
    assert fixed.method == "dense" and fixed.num_reused == 0
    assert fixed.reason == "kvcomm: its prefix offsets were measured against another version of it"


def test_a_long_placeholder_is_measured_chunk_by_chunk_then_reproduced_exactly(deep_llama):
    eng = engine(deep_llama, chunk_tokens=8)
    agent, sample, earlier = Agent(70), tokens(30, 71), tokens(26, 72)
    produce(eng, earlier)
    prefill_kv(eng, *agent.prompt(earlier), ReuseScope("app", None))  # the instruction's base
    produce(eng, sample)
    ids, segs = agent.prompt(sample)
    dense_kv, _ = prefill_kv(eng, ids)
    _, measured = prefill_kv(eng, ids, segs, SCOPE_A)
    first = outcome_of(measured, segs[1].start)
    assert first.method == "dense" and first.kvcomm["chunks"] == 4 and first.kvcomm["chunks_predicted"] == 0
    pools = eng.anchor_bank.pools
    assert [len(pools[("default", "app", "user_question", j)].anchors[0].token_ids) for j in range(4)] == [8, 8, 8, 6]
    assert eng.anchor_bank.stats()["measured_tokens"] == len(sample)

    kv, seq = prefill_kv(eng, ids, segs, SCOPE_A)
    ph = outcome_of(seq, segs[1].start)
    assert ph.method == "kvcomm" and ph.num_reused == len(sample)
    assert ph.kvcomm == {"anchor": "exact", "anchors_used": 4, "chunks": 4, "chunks_predicted": 4}
    assert outcome_of(seq, segs[2].start).method == "kvcomm"  # the last chunk's prefix offsets
    for (k, v), (dk, dv) in zip(kv, dense_kv):
        torch.testing.assert_close(k, dk, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(v, dv, atol=2e-5, rtol=1e-5)
    assert eng.anchor_bank.stats()["predicted_tokens"] == len(sample)


@pytest.mark.parametrize("chunk_tokens", [8, 128])
def test_a_new_text_longer_than_every_anchor_is_predicted_from_earlier_chunk_positions(deep_llama, chunk_tokens):
    eng = engine(deep_llama, chunk_tokens=chunk_tokens)
    agent, short = Agent(73), tokens(30, 74)
    produce(eng, short)
    prefill_kv(eng, *agent.prompt(short), SCOPE_A)  # measured: chunks of 8, 8, 8, 6
    longer = tokens(40, 75)
    produce(eng, longer)
    ids, segs = agent.prompt(longer)
    _, seq = prefill_kv(eng, ids, segs, SCOPE_A)
    ph = outcome_of(seq, segs[1].start)
    if chunk_tokens == 128:  # one sample: no anchor is as long, so it is measured again
        assert ph.method == "dense" and ph.kvcomm["anchor"] == "new"
        return
    # Chunk 3 (8 tokens; position 3's anchor has 6) and chunk 4 (no anchor there) use position 2's.
    assert ph.method == "kvcomm" and ph.num_reused == len(longer)
    assert ph.kvcomm["chunks"] == ph.kvcomm["chunks_predicted"] == 5
    assert ph.kvcomm["anchor"] == "hit" and ph.kvcomm["chunks_from_earlier_positions"] == 2


def test_a_text_another_agent_measured_is_predicted_from_the_readers_own_anchors(deep_llama):
    eng = engine(deep_llama, chunk_tokens=16)
    a, b = Agent(76), Agent(77)
    scope_b = ReuseScope("app", "agent-b")
    older, newer = tokens(30, 78), tokens(30, 79)
    produce(eng, older)
    prefill_kv(eng, *b.prompt(older), scope_b)  # b's anchors, from an earlier task
    produce(eng, newer)
    prefill_kv(eng, *a.prompt(newer), SCOPE_A)  # a measures the new text first
    measured = eng.anchor_bank.stats()["measured_tokens"]
    ids, segs = b.prompt(newer)
    _, seq = prefill_kv(eng, ids, segs, scope_b)
    ph = outcome_of(seq, segs[1].start)
    assert ph.method == "kvcomm" and ph.kvcomm["anchor"] == "hit" and ph.num_reused == len(newer)
    assert eng.anchor_bank.stats()["measured_tokens"] == measured  # no second measurement


def predicted_with_repair(model_dir, ratio: float):
    """A new sample predicted from another sample's anchor, with `recompute_ratio` set:
    (its placeholder's outcome, the follower's, the placeholder's last-layer key error
    against the dense prefill)."""
    eng = engine(model_dir, recompute_ratio=ratio)
    agent = Agent(40)
    measured = tokens(30, 41)
    produce(eng, measured)
    prefill_kv(eng, *agent.prompt(measured), SCOPE_A)
    new = tokens(28, 42)
    produce(eng, new)
    ids, segs = agent.prompt(new)
    dense_kv, _ = prefill_kv(eng, ids)
    kv, seq = prefill_kv(eng, ids, segs, SCOPE_A)
    ph = slice(segs[1].start, segs[1].end)
    error = float((kv[-1][0][ph] - dense_kv[-1][0][ph]).norm())
    return outcome_of(seq, segs[1].start), outcome_of(seq, segs[2].start), error


def test_a_predicted_placeholder_recomputes_its_most_deviating_share_and_moves_towards_dense(deep_llama):
    plain, plain_follower, plain_error = predicted_with_repair(deep_llama, 0.0)
    assert plain.kvcomm["anchor"] == "hit" and plain.num_recomputed == 0
    repaired, follower, error = predicted_with_repair(deep_llama, 0.25)
    assert repaired.method == "kvcomm" and repaired.kvcomm["anchor"] == "hit"
    assert repaired.num_recomputed == math.ceil(0.25 * 28) and repaired.num_reused == 28 - math.ceil(0.25 * 28)
    assert follower.method == "kvcomm" and follower.num_recomputed == math.ceil(0.25 * follower.segment.num_tokens)
    assert plain_follower.num_recomputed == 0
    assert error < plain_error


def test_a_placeholder_reproduced_from_its_exact_anchor_recomputes_nothing(deep_llama):
    eng = engine(deep_llama, recompute_ratio=0.25)
    agent, sample = Agent(43), tokens(30, 44)
    produce(eng, sample)
    ids, segs = agent.prompt(sample)
    prefill_kv(eng, ids, segs, SCOPE_A)  # measured
    _, seq = prefill_kv(eng, ids, segs, SCOPE_A)
    ph = outcome_of(seq, segs[1].start)
    assert ph.kvcomm["anchor"] == "exact" and ph.num_reused == len(sample) and ph.num_recomputed == 0


# -- new_samples="readers" (the default) ------------------------------------------------
def answer_of(eng: LLMEngine, writer: Agent, question: list[int], num_tokens: int = 24) -> list[int]:
    """A writer's answer, kept by the engine as generated KV (as every agent's answer is);
    returns the tokens the index holds for it."""
    ids = writer.system + question
    seq = eng.generate(ids, SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True),
                       segments=[TokenSegment(0, len(writer.system), "fixed_prefix", "writer")], publish=False)
    out = list(seq.output_token_ids)
    kept = next(out[:n] for n in range(len(out), 3, -1) if eng.segment_index.peek(out[:n], scope_tenant()))
    assert eng.segment_index.peek(kept, scope_tenant()).generated
    return kept


def scope_tenant() -> str:
    return SCOPE_A.tenant


def test_readers_an_answer_is_computed_by_its_first_reader_and_placed_from_that_kv_for_the_next(deep_llama):
    eng = engine(deep_llama, new_samples="readers", chunk_tokens=8)
    a, b = Agent(80), Agent(81)
    answer = answer_of(eng, Agent(82), tokens(20, 83))
    ids_a, segs_a = a.prompt(answer)
    kv_a, seq_a = prefill_kv(eng, ids_a, segs_a, SCOPE_A)
    first = outcome_of(seq_a, segs_a[1].start)
    assert first.method == "dense" and first.kvcomm["anchor"] == "new"  # measured: computed here
    measured = eng.anchor_bank.stats()["measured_tokens"]
    assert measured == len(answer)

    ids_b, segs_b = b.prompt(answer)
    kv_b, seq_b = prefill_kv(eng, ids_b, segs_b, ReuseScope("app", "agent-b"))
    later = outcome_of(seq_b, segs_b[1].start)
    assert later.method == "kvcomm" and later.kvcomm["anchor"] == "reader" and later.num_reused == len(answer)
    assert eng.anchor_bank.stats()["measured_tokens"] == measured  # not measured again
    span = slice(segs_b[1].start, segs_b[1].end)  # both systems are 19 tokens: the same positions
    for (k_a, v_a), (k_b, v_b) in zip(kv_a, kv_b):
        torch.testing.assert_close(k_b[span], k_a[span], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(v_b[span], v_a[span], atol=1e-5, rtol=1e-5)


def test_readers_a_text_a_prompt_computed_is_placed_by_its_shift_and_never_measured(deep_llama):
    eng = engine(deep_llama, new_samples="readers")
    agent, question = Agent(84), tokens(30, 85)
    produce(eng, question)  # registered from a prompt, as a task's question is
    ids, segs = agent.prompt(question)
    _, seq = prefill_kv(eng, ids, segs, SCOPE_A)
    ph = outcome_of(seq, segs[1].start)
    assert ph.method == "kvcomm" and ph.kvcomm == {"anchor": "shift", "anchors_used": 0}
    assert ph.num_reused == len(question) and eng.anchor_bank.stats()["measured_tokens"] == 0
