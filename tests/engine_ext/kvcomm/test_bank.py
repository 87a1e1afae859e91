"""AnchorBank against a real SegmentIndex, no model: offsets are keyed to the exact base
(content and version) they were measured against. An entry evicted by the pool's LRU and
registered again is a new version; anchors measured against the old one are refused
(counted in the decision's detail), re-measured, and never added to the new KV."""

from __future__ import annotations

from typing import NamedTuple

import torch

from engine_ext.config import AnchorConfig, EngineConfig, ModelConfig
from engine_ext.kv.blobs import Blob
from engine_ext.kv.block_pool import Block, BlockPool
from engine_ext.kv.cache import KVCache
from engine_ext.kv.segment_index import SegmentEntry, SegmentIndex
from engine_ext.kvcomm import Anchor, AnchorBank, Decision, Measurement
from engine_ext.rope import RopeShifter

BLOCK = 4
POOL = ("default", "app", "user_question", 0)
SAMPLE = tuple(range(10, 22))  # 12 tokens: 3 blocks
INSTRUCTION = tuple(range(40, 48))  # the fixed segment after the placeholder: 2 blocks
SYSTEM = 6  # tokens before the placeholder in the agent's prompt
TEMPLATE = 2  # tokens between the placeholder and the instruction


class Rig(NamedTuple):
    index: SegmentIndex
    bank: AnchorBank
    kv_cache: KVCache
    pool: BlockPool


def rig(num_blocks: int = 48, gamma: float = 0.3, new_samples: str = "predict") -> Rig:
    """Most tests here exercise the paper's prediction from other samples' anchors; the
    default ("readers") is tested at the end."""
    model = ModelConfig(model_type="llama", vocab_size=256, hidden_size=32, intermediate_size=64, num_layers=3,
                        num_heads=2, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=512,
                        tie_word_embeddings=False, qkv_bias=False, qk_norm=False)
    kv_cache = KVCache(model, EngineConfig(kv_cache_bytes=num_blocks * BLOCK * model.kv_bytes_per_token(4),
                                           block_size=BLOCK))
    pool = BlockPool(kv_cache.num_blocks)
    index = SegmentIndex(pool, kv_cache, RopeShifter.for_model(model), "test")
    config = AnchorConfig(gamma=gamma, new_samples=new_samples)  # type: ignore[arg-type]
    return Rig(index, AnchorBank(config, index, kv_cache, "test"), kv_cache, pool)


class Prompt(NamedTuple):
    slots: torch.Tensor  # (P,)
    blocks: list[Block]


def prompt(r: Rig, num_tokens: int, seed: int) -> Prompt:
    """Blocks of a running prompt holding random KV (what a prefill would have written)."""
    blocks = r.pool.allocate(-(-num_tokens // BLOCK))
    ids = torch.tensor([b.block_id for b in blocks])
    slots = (ids[:, None] * BLOCK + torch.arange(BLOCK)[None, :]).flatten()[:num_tokens]
    gen = torch.Generator().manual_seed(seed)
    for k, v in r.kv_cache.layers:
        k[slots] = torch.randn(num_tokens, *k.shape[1:], generator=gen)
        v[slots] = torch.randn(num_tokens, *v.shape[1:], generator=gen)
    return Prompt(slots, blocks)


def done(r: Rig, p: Prompt) -> None:
    r.pool.release(list(reversed(p.blocks)))


def produce(r: Rig, tokens: tuple[int, ...], seed: int, generated: bool = False) -> SegmentEntry:
    """Register `tokens` from a prompt of its own (its KV depends on `seed`: another
    context gives other KV) and return the index's entry; `generated`: as an answer."""
    p = prompt(r, 5 + len(tokens), seed)
    assert r.index.register(list(tokens), p.slots[5:], 5, generated=generated)
    done(r, p)
    entry = r.index.lookup(tokens)
    assert entry is not None
    return entry


def evict(r: Rig, keep: list[Blob]) -> None:
    """The pool's LRU evicts every unpinned cached block (a burst of other prompts),
    sparing the blobs in `keep`."""
    for blob in keep:
        r.index.blobs.acquire(blob)
    taken = r.pool.allocate(r.pool.num_free)
    r.pool.release(list(reversed(taken)))
    for blob in keep:
        r.index.blobs.release(blob)


def run_agent(r: Rig, sample: tuple[int, ...], seed: int, agent: str = "a") -> Decision:
    """Admit the agent's prompt (system | sample | template | instruction): decide, then,
    as the assembler does after the prefill, commit or record."""
    entry = r.index.lookup(sample)
    assert entry is not None
    decision = r.bank.decide(POOL, agent, sample, entry, INSTRUCTION)
    if decision.predicted:
        r.bank.commit(decision)
        return decision
    p = prompt(r, SYSTEM + len(sample) + TEMPLATE + len(INSTRUCTION), seed)
    r.index.acquire(entry)
    follower = SYSTEM + len(sample) + TEMPLATE
    m = Measurement(decision, sample, SYSTEM, entry, INSTRUCTION, follower)
    assert r.bank.record(m, p.slots)
    r.index.release(entry)
    done(r, p)
    return decision


def the_anchor(r: Rig) -> Anchor:
    (anchor,) = r.bank.pools[POOL].anchors
    return anchor


def anchor_blobs(r: Rig) -> list[Blob]:
    return [b for a in r.bank.pools[POOL].anchors for b in a.blobs()]


def test_a_registration_again_is_a_new_version_of_the_same_content():
    r = rig()
    old = produce(r, SAMPLE, seed=1)
    hits = r.index.num_hits
    assert r.index.peek(SAMPLE) == old and r.index.num_hits == hits  # peeking counts nothing
    assert r.index.is_current(old)
    evict(r, keep=[])
    assert r.index.lookup(SAMPLE) is None and not r.index.is_current(old)
    new = produce(r, SAMPLE, seed=2)
    assert new.key == old.key and new.version > old.version
    assert new.identity != old.identity
    assert r.index.is_current(new) and not r.index.is_current(old)


def test_an_unchanged_entry_keeps_its_exact_hits():
    r = rig()
    produce(r, INSTRUCTION, seed=3)
    produce(r, SAMPLE, seed=1)
    first = run_agent(r, SAMPLE, seed=10)
    assert not first.predicted and first.detail == {"anchor": "new", "anchors_used": 0, "eligible": 0}
    # Another text's entry evicted and registered again changes nothing for this one.
    other = tuple(range(60, 68))
    produce(r, other, seed=4)
    evict(r, keep=anchor_blobs(r) + [r.index.lookup(SAMPLE).blob, r.index.lookup(INSTRUCTION).blob])
    produce(r, other, seed=5)
    for _ in range(2):
        d = run_agent(r, SAMPLE, seed=11)
        assert d.predicted and d.detail == {"anchor": "exact", "anchors_used": 1}
        assert d.prefix is not None and d.prefix_base == r.index.lookup(INSTRUCTION).identity
    assert the_anchor(r).num_activations == 2


def test_offsets_of_an_evicted_and_reregistered_base_are_never_applied_to_the_new_one():
    r = rig()
    produce(r, INSTRUCTION, seed=3)
    old = produce(r, SAMPLE, seed=1)
    run_agent(r, SAMPLE, seed=10)
    assert run_agent(r, SAMPLE, seed=11).detail["anchor"] == "exact"
    stale = the_anchor(r)
    assert stale.base_identity.entry == old.identity and stale.num_activations == 1
    # The LRU evicts the sample's entry (the anchor and the instruction stay); the sample is
    # computed again behind another prefix and registered: same tokens, other KV.
    evict(r, keep=anchor_blobs(r) + [r.index.lookup(INSTRUCTION).blob])
    new = produce(r, SAMPLE, seed=2)
    assert new.key == old.key and new.identity != stale.base_identity.entry
    v_old = r.kv_cache.layers[-1][1][r.bank.blobs.slots(stale.base)]
    v_new = r.kv_cache.layers[-1][1][r.index.slots(new)]
    assert not torch.allclose(v_old, v_new)  # real - old base + new base would not be the real KV

    refused = run_agent(r, SAMPLE, seed=12)
    assert not refused.predicted and refused.placeholder is None and refused.anchors == []
    assert refused.detail == {"anchor": "new", "anchors_used": 0, "eligible": 0, "stale_anchors": 1}
    # Re-measured against the new version: replaced in place, its activations kept.
    fresh = the_anchor(r)
    assert fresh is not stale and fresh.base_identity.entry == new.identity and fresh.num_activations == 1
    assert not r.bank.blobs.valid(stale.base)  # the old blobs are freed
    again = run_agent(r, SAMPLE, seed=13)
    assert again.predicted and again.detail == {"anchor": "exact", "anchors_used": 1}
    assert again.anchors == [fresh]


def test_a_stale_exact_anchor_is_absent_for_its_sample_but_still_a_neighbour_for_others():
    r = rig(gamma=1.0)
    produce(r, INSTRUCTION, seed=3)
    produce(r, SAMPLE, seed=1)
    run_agent(r, SAMPLE, seed=10)
    evict(r, keep=anchor_blobs(r) + [r.index.lookup(INSTRUCTION).blob])
    produce(r, SAMPLE, seed=2)
    stale = the_anchor(r)
    # Its own sample: not exact, and not its own neighbour either (gamma 1 would predict).
    d = r.bank.decide(POOL, "a", SAMPLE, r.index.lookup(SAMPLE), INSTRUCTION)
    assert not d.predicted and d.detail["stale_anchors"] == 1
    # Another, shorter sample: the anchor's base copy matches its offsets, so it predicts.
    shorter = SAMPLE[:8]
    produce(r, shorter, seed=6)
    hit = r.bank.decide(POOL, "a", shorter, r.index.lookup(shorter), INSTRUCTION)
    assert hit.predicted and hit.anchors == [stale] and hit.detail["anchor"] == "hit"
    assert "stale_anchors" not in hit.detail and "stale_prefix_offsets" not in hit.detail
    assert hit.prefix is not None


def test_prefix_offsets_of_another_version_of_the_fixed_segment_are_refused():
    r = rig(gamma=1.0)
    produce(r, INSTRUCTION, seed=3)
    produce(r, SAMPLE, seed=1)
    run_agent(r, SAMPLE, seed=10)
    shorter = SAMPLE[:8]
    produce(r, shorter, seed=6)
    evict(r, keep=anchor_blobs(r) + [r.index.lookup(SAMPLE).blob, r.index.lookup(shorter).blob])
    instruction = produce(r, INSTRUCTION, seed=7)  # the fixed segment, registered again
    assert the_anchor(r).offsets["a"].prefix_base != instruction.identity
    for sample, kind in ((SAMPLE, "exact"), (shorter, "hit")):
        d = r.bank.decide(POOL, "a", sample, r.index.lookup(sample), INSTRUCTION)
        # The placeholder's own offsets still apply (its base is unchanged); the prefix's do not.
        assert d.predicted and d.detail["anchor"] == kind and d.placeholder is not None
        assert d.prefix is None and d.prefix_base is None and d.detail["stale_prefix_offsets"] == 1


# -- new_samples="readers" (the default) ------------------------------------------------
def test_an_answer_is_measured_by_its_first_reader_and_later_readers_get_that_readers_kv():
    r = rig(new_samples="readers")
    produce(r, INSTRUCTION, seed=3)
    entry = produce(r, SAMPLE, seed=1, generated=True)
    first = r.bank.decide(POOL, "a", SAMPLE, entry, INSTRUCTION)
    assert not first.predicted and first.detail["anchor"] == "new"
    reader = prompt(r, SYSTEM + len(SAMPLE) + TEMPLATE + len(INSTRUCTION), seed=10)
    r.index.acquire(entry)
    assert r.bank.record(Measurement(first, SAMPLE, SYSTEM, entry, INSTRUCTION, SYSTEM + len(SAMPLE) + TEMPLATE),
                         reader.slots)
    r.index.release(entry)

    later = r.bank.decide(POOL, "b", SAMPLE, entry, INSTRUCTION)
    assert later.predicted and later.detail["anchor"] == "reader"
    assert (later.agent_id, later.source_agent, later.anchors) == ("b", "a", [the_anchor(r)])
    assert r.bank.blobs_of(later) == the_anchor(r).offsets["a"].blobs()
    assert later.prefix is not None  # the same instruction follows: a's offsets for it too

    # Placed at another position, the sample's KV is the first reader's, moved there.
    position = 9
    dst = prompt(r, len(SAMPLE), seed=99).slots
    r.index.copy_shifted(r.index.slots(entry), dst, position)
    later.placeholder.apply(r.kv_cache, r.index.shifter, dst, position)
    for k_cache, v_cache in r.kv_cache.layers[1:]:
        theirs = reader.slots[SYSTEM : SYSTEM + len(SAMPLE)]
        expected_k = r.index.shifter.shift(k_cache[theirs].float(), position - SYSTEM)
        torch.testing.assert_close(k_cache[dst].float(), expected_k, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(v_cache[dst].float(), v_cache[theirs].float(), atol=1e-5, rtol=1e-5)

    # Measuring it anyway (another chunk of its placeholder must be) records b's own offsets.
    assert r.bank.measuring(later).agent_id == "b"
    assert r.bank.num_measured == 1


def test_a_text_a_prompt_computed_is_placed_by_its_shift_alone_and_never_measured():
    r = rig(new_samples="readers")
    produce(r, INSTRUCTION, seed=3)
    produce(r, SAMPLE, seed=1)  # a question or document: its base is a prompt's KV already
    for agent in ("a", "b"):
        decision = run_agent(r, SAMPLE, seed=10, agent=agent)
        assert decision.predicted and decision.detail == {"anchor": "shift", "anchors_used": 0}
        assert (decision.anchors, decision.placeholder, decision.prefix) == ([], None, None)
        assert r.bank.blobs_of(decision) == []
    assert r.bank.num_measured == 0 and POOL not in r.bank.pools


def test_an_agents_own_measurement_stays_exact_and_a_stale_one_is_measured_again():
    r = rig(new_samples="readers")
    produce(r, INSTRUCTION, seed=3)
    produce(r, SAMPLE, seed=1, generated=True)
    assert run_agent(r, SAMPLE, seed=10, agent="a").detail["anchor"] == "new"
    assert run_agent(r, SAMPLE, seed=10, agent="a").detail["anchor"] == "exact"
    anchor = the_anchor(r)
    evict(r, keep=anchor.blobs())
    produce(r, INSTRUCTION, seed=3)
    produce(r, SAMPLE, seed=2, generated=True)  # the answer again, other KV: a new version
    again = run_agent(r, SAMPLE, seed=11, agent="b")
    assert not again.predicted and again.detail == {"anchor": "new", "anchors_used": 0, "stale_anchors": 1}
    assert the_anchor(r).offsets.keys() == {"b"}  # replaced: a's offsets were for the old version


def chunk_measurements(r: Rig, entry: SegmentEntry, agent: str = "a") -> list[Measurement]:
    """SAMPLE cut into block-sized chunks, each decided in its own chunk position's pool
    (a new text: measured), the instruction following the last chunk, as the assembler
    cuts a placeholder."""
    out = []
    for c, start in enumerate(range(0, len(SAMPLE), BLOCK)):
        tokens = SAMPLE[start : start + BLOCK]
        follower = INSTRUCTION if start + BLOCK >= len(SAMPLE) else None
        decision = r.bank.decide((*POOL[:3], c), agent, tokens, entry, follower, offset=start)
        assert not decision.predicted
        out.append(Measurement(decision, tokens, SYSTEM + start, entry, follower, SYSTEM + len(SAMPLE) + TEMPLATE,
                               offset=start))
    return out


def recorded_kv(r: Rig) -> list[tuple[torch.Tensor, ...]]:
    """Per chunk position: its anchor's base, and agent a's placeholder and prefix offsets, as (K, V) per layer."""
    out = []
    for c in range(len(SAMPLE) // BLOCK):
        (anchor,) = r.bank.pools[(*POOL[:3], c)].anchors
        blobs = [anchor.base, *anchor.offsets["a"].blobs()]
        out.append(tuple(cache[r.index.blobs.slots(b)].clone() for b in blobs for kv in r.kv_cache.layers for cache in kv))
    return out


def test_a_prompts_chunks_recorded_together_equal_each_recorded_alone_and_the_definition():
    together, alone = rig(), rig()
    for r, batched in ((together, True), (alone, False)):
        entry = produce(r, SAMPLE, seed=1)
        produce(r, INSTRUCTION, seed=3)
        p = prompt(r, SYSTEM + len(SAMPLE) + TEMPLATE + len(INSTRUCTION), seed=10)
        measurements = chunk_measurements(r, entry)
        r.index.acquire(entry)
        if batched:
            assert r.bank.record_all(measurements, p.slots) == 3
        else:
            assert all(r.bank.record(m, p.slots) for m in measurements)
        r.index.release(entry)
        assert r.bank.num_measured == 3 and r.bank.num_measured_tokens == len(SAMPLE)
    for mine, theirs in zip(recorded_kv(together), recorded_kv(alone), strict=True):
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))

    # Against the definition: offset = real (keys rotated back by the chunk's start) - base chunk in its own frame.
    r, shift = together, together.index.shifter
    entry = r.index.lookup(SAMPLE)
    assert entry is not None
    for c in range(len(SAMPLE) // BLOCK):
        (anchor,) = r.bank.pools[(*POOL[:3], c)].anchors
        start = c * BLOCK
        real = p.slots[SYSTEM + start : SYSTEM + start + BLOCK]
        base = r.index.slots(entry)[start : start + BLOCK]
        offset = r.index.blobs.slots(anchor.offsets["a"].placeholder)
        for k_cache, v_cache in r.kv_cache.layers:
            expected_k = shift.shift(k_cache[real].float(), -(SYSTEM + start)) - shift.shift(k_cache[base], -start)
            torch.testing.assert_close(k_cache[offset], expected_k, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(v_cache[offset], v_cache[real] - v_cache[base])


def test_a_chunk_met_twice_in_one_prompt_is_recorded_once_and_a_chunk_without_room_gives_its_blocks_back():
    r = rig()
    entry = produce(r, SAMPLE, seed=1)
    p = prompt(r, SYSTEM + len(SAMPLE) + TEMPLATE + len(INSTRUCTION), seed=10)
    first, *_ = chunk_measurements(r, entry)
    r.index.acquire(entry)
    assert r.bank.record_all([first, first], p.slots) == 1
    assert r.bank.num_measured == 1 and r.bank.num_measured_tokens == 2 * BLOCK

    r = rig(num_blocks=16)
    entry = produce(r, SAMPLE, seed=1)
    p = prompt(r, SYSTEM + len(SAMPLE) + TEMPLATE, seed=10)
    measurements = chunk_measurements(r, entry)[:2]  # each needs 2 blocks: its base and its offsets
    r.index.acquire(entry)
    hog = r.pool.allocate(r.pool.num_free - 3)  # room for one chunk's blobs and a block, not for two chunks'
    assert r.bank.record_all(measurements, p.slots) == 1
    assert r.bank.num_skipped == 1 and r.pool.num_free == 3  # sealed blobs are evictable; nothing leaked
    r.index.release(entry)
    done(r, p)
    r.pool.release(hog)
    assert r.index.lookup(SAMPLE) == entry  # still held: nothing it was measured against was evicted
    (anchor,) = r.bank.pools[(*POOL[:3], 0)].anchors
    assert r.index.blobs.valid(anchor.base) and r.index.blobs.valid(anchor.offsets["a"].placeholder)
