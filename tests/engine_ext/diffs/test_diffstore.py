"""DiffStore: a round's caches as one master and block-sparse mirrors, restored bit-exactly."""

from __future__ import annotations

import pytest
import torch

from engine_ext.collective import GroupMember
from engine_ext.config import CollectiveConfig
from engine_ext.diffs import CacheImage, DiffStore, MirrorView
from engine_ext.diffs.stored import MirrorRows
from kvrelay.wire.plan import RoundInfo
from engine_ext.reuse.segments import ReuseScope
from engine_ext.sampling import SamplingParams
from tests.engine_ext.collective.round_support import Round, engine, run_all, tokens
from engine_ext.request import EngineRequest


@pytest.fixture(scope="module")
def deep_llama(tiny_model_dir):
    return tiny_model_dir("llama", num_hidden_layers=4)


def _kv(eng, slots: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(k.index_select(0, slots).clone(), v.index_select(0, slots).clone()) for k, v in eng.kv_cache.layers]


def _assert_equal(a, b) -> None:
    for (k1, v1), (k2, v2) in zip(a, b):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


def _fresh_slots(eng, n: int) -> tuple[list, torch.Tensor]:
    blocks = eng.kv.pool.allocate(-(-n // eng.kv.block_size))
    ids = torch.tensor([b.block_id for b in blocks])
    return blocks, (ids[:, None] * eng.kv.block_size + torch.arange(eng.kv.block_size)).flatten()[:n]


class RoundCaches:
    """One collective round run by hand: its members, images and plan, before anything is stored."""

    def __init__(self, eng, rnd: Round) -> None:
        rnd.cache_outputs(eng)
        seqs = rnd.add(eng)
        eng.scheduler.schedule()
        group = seqs[0].group
        self.members = [GroupMember(s.request_id, s.assembly, s.token_ids, eng.kv.slots(s, s.num_tokens))
                        for s in group.members]
        self.plan = eng.runner.collective.run(group.round_id, self.members).plan
        self.images = eng.runner.collective.images(self.members, self.plan)
        self.snapshots = [_kv(eng, img.slots[img.region_start :]) for img in self.images]


def test_restore_is_bit_exact_with_lossless_diffs(deep_llama):
    eng = engine(deep_llama, blend_ratio=0.25, collective=CollectiveConfig(diff_block_tokens=8))
    rc = RoundCaches(eng, Round.make(num_agents=3, output_len=48))
    store = eng.diff_store
    result = store.store_round(rc.images, rc.plan.master)
    assert result.master_bytes > 0 and sum(b is not None for b in result.mirror_bytes) == 2
    for image, snapshot in zip(rc.images, rc.snapshots):
        view = store.read(image.token_ids)
        assert view is not None and view.num_tokens == len(image.token_ids)
        for restore in (view.restore, view.restore_dense):
            blocks, dst = _fresh_slots(eng, image.num_region_tokens)
            restore(eng.kv_cache.layers, dst)
            _assert_equal(_kv(eng, dst), snapshot)
            eng.kv.pool.release(blocks)
    mirrors = [store.read(img.token_ids) for i, img in enumerate(rc.images) if i != rc.plan.master]
    assert all(isinstance(m, MirrorView) for m in mirrors)
    # Siblings differ only where they recomputed or hold their own text: most blocks are the master's.
    touched = store.stats()["mirror_touched_blocks"]
    total = sum(int(m.block_diff.numel()) for m in mirrors)
    assert 0 < touched < total


def test_mirrors_of_identical_caches_are_empty(deep_llama):
    eng = engine(deep_llama)
    rc = RoundCaches(eng, Round.make(num_agents=3))
    image = rc.images[0]
    assert image.region_start > 0
    blocks, twin_slots = _fresh_slots(eng, len(image.token_ids))
    for k, v in eng.kv_cache.layers:  # the same KV in other blocks, under a prompt differing before the region
        k.index_copy_(0, twin_slots, k.index_select(0, image.slots))
        v.index_copy_(0, twin_slots, v.index_select(0, image.slots))
    twin = CacheImage((image.token_ids[0] + 1,) + image.token_ids[1:], twin_slots, image.region_start, image.runs)
    result = eng.diff_store.store_round([image, twin], master=0)
    mirror = eng.diff_store._stored[eng.diff_store._key(twin.token_ids)]
    assert mirror.num_touched == 0 and mirror.diff is None and mirror.rows == MirrorRows(0, 0, 0)
    assert result.mirror_bytes == [None, mirror.metadata_bytes]
    restored_blocks, dst = _fresh_slots(eng, twin.num_region_tokens)
    eng.diff_store.read(twin.token_ids).restore(eng.kv_cache.layers, dst)
    _assert_equal(_kv(eng, dst), rc.snapshots[0])
    eng.kv.pool.release(blocks + restored_blocks)


def test_a_row_whose_values_moved_is_stored_as_differing_with_its_block(deep_llama):
    eng = engine(deep_llama)
    rc = RoundCaches(eng, Round.make(num_agents=3))
    image = rc.images[0]
    blocks, twin_slots = _fresh_slots(eng, len(image.token_ids))
    for k, v in eng.kv_cache.layers:
        k.index_copy_(0, twin_slots, k.index_select(0, image.slots))
        v.index_copy_(0, twin_slots, v.index_select(0, image.slots))
    row = image.region_start + 3
    eng.kv_cache.layers[1][0][twin_slots[row]] += 1.0  # one row's keys of one layer moved
    twin = CacheImage((image.token_ids[0] + 1,) + image.token_ids[1:], twin_slots, image.region_start, image.runs)
    eng.diff_store.store_round([image, twin], master=0)
    mirror = eng.diff_store._stored[eng.diff_store._key(twin.token_ids)]
    assert mirror.num_touched == 1 and mirror.rows.unshared == 0 and mirror.rows.differing == 1
    assert sum(mirror.rows) == int(mirror.diff.num_tokens)  # the rest of its block rides along
    eng.kv.pool.release(blocks)


def test_memory_accounting_of_master_and_mirrors(deep_llama):
    eng = engine(deep_llama)
    rc = RoundCaches(eng, Round.make(num_agents=3))
    store = eng.diff_store
    bytes_per_block, bs = eng.kv_cache.bytes_per_block, eng.kv_cache.block_size
    result = store.store_round(rc.images, rc.plan.master)
    master = rc.images[rc.plan.master]
    assert result.master_bytes == -(-master.num_region_tokens // bs) * bytes_per_block
    assert result.dense_bytes == [-(-img.num_region_tokens // bs) * bytes_per_block for img in rc.images]
    mirrors = [store._stored[store._key(img.token_ids)] for i, img in enumerate(rc.images) if i != rc.plan.master]
    sibling_bytes = [b for i, b in enumerate(result.mirror_bytes) if i != rc.plan.master]
    for mirror, num_bytes in zip(mirrors, sibling_bytes):
        stored_tokens = int(mirror.diff.num_tokens) if mirror.diff else 0
        assert stored_tokens < master.num_region_tokens
        assert num_bytes == -(-stored_tokens // bs) * bytes_per_block + mirror.metadata_bytes
        assert sum(mirror.rows) == stored_tokens  # every stored row has one reason
    assert store.mirror_rows == MirrorRows(*(sum(m.rows[i] for m in mirrors) for i in range(3)))
    assert store.mirrored_rows == sum(img.num_region_tokens for i, img in enumerate(rc.images) if i != rc.plan.master)
    stats = store.stats()
    assert (stats["masters"], stats["mirrors"]) == (1, 2)
    assert stats["master_bytes"] + stats["mirror_bytes"] == result.num_stored_bytes < sum(result.dense_bytes)
    # Stored caches share the pool's LRU: allocating every block evicts them, and reads miss.
    eng.kv.pool.release(eng.kv.pool.allocate(eng.kv.pool.num_free))
    assert store.read(rc.images[0].token_ids) is None
    assert store.stats() == {"masters": 0, "mirrors": 0, "master_bytes": 0, "mirror_bytes": 0,
                             "mirror_touched_blocks": 0}


def test_a_cache_outside_a_round_mirrors_the_most_similar_master(deep_llama):
    eng = engine(deep_llama)
    rc = RoundCaches(eng, Round.make(num_agents=3))
    store: DiffStore = eng.diff_store
    first = store.store(rc.images[0])
    second = store.store(rc.images[1])
    assert type(first).__name__ == "StoredMaster" and type(second).__name__ == "StoredMirror"
    assert second.master is first
    unrelated = CacheImage(tuple(tokens(40, 7)), rc.images[2].slots[:40], 16, [])
    assert type(store.store(unrelated)).__name__ == "StoredMaster"


def test_tolerance_keeps_near_equal_blocks_out_of_the_mirror(deep_llama):
    eng = engine(deep_llama)
    rc = RoundCaches(eng, Round.make(num_agents=3))
    image = rc.images[1]
    run = image.runs[0]
    row = int(run.exact.nonzero()[0]) + run.start
    k = eng.kv_cache.layers[2][0]
    k[image.slots[row]] += 1e-5  # one value of one canonical token, off by a rounding error
    lossless = eng.diff_store.store_round([rc.images[0], image], master=0)
    lossy_store = DiffStore(eng.segment_index.blobs, eng.kv_cache, eng.segment_index.shifter.inv_freq,
                            "lossy", block_tokens=32, tolerance=1e-4)
    lossy = lossy_store.store_round([rc.images[0], image], master=0)
    assert lossy.mirror_bytes[1] < lossless.mirror_bytes[1]


def test_a_prompt_extending_a_stored_round_prompt_is_restored(deep_llama):
    eng = engine(deep_llama)
    rnd = Round.make(num_agents=3)
    rnd.cache_outputs(eng)
    seqs = rnd.add(eng, publish=True, max_tokens=2)
    eng.step()  # the round's collective prefill (stored), one token each
    snapshots = [_kv(eng, eng.kv.slots(s, s.num_prompt_tokens)) for s in seqs]
    while eng.has_work:
        eng.step()
    ids, segments = rnd.prompt(1)
    extended = ids + tokens(5, 42)
    seq = eng.generate(extended, SamplingParams(max_tokens=2, temperature=0.0), segments=segments, publish=False)
    assert eng.lifecycle.restorer.num_restores == 1
    assert seq.num_cached_tokens == len(ids)
    assert all(o.method == "restored" and o.num_reused == o.segment.num_tokens for o in seq.reuse_outcomes)
    (restore,) = seq.timeline.assembly["diff_restore"]  # timed at admission, as part of the prefill
    assert 0 < restore.num_tokens <= len(ids) and seq.timeline.stages()["prefill"].holds(restore)
    # Restored KV is the agent's own round KV, bit for bit (checked on a rerun that stops after prefill).
    again = eng.add_request(EngineRequest("again", extended, SamplingParams(max_tokens=2), segments=segments, publish=False))
    eng.step()
    region = eng.diff_store.read(ids).region_start
    restored = _kv(eng, eng.kv.slots(again, len(ids))[region:])
    _assert_equal(restored, [(k[region:], v[region:]) for k, v in snapshots[1]])
    while eng.has_work:
        eng.step()


def _stored_round(model_dir) -> tuple:
    """An engine after one collective round of three agents, its caches stored."""
    eng = engine(model_dir)
    rnd = Round.make(num_agents=3)
    rnd.cache_outputs(eng)
    rnd.add(eng, publish=True)
    run_all(eng)
    return eng, rnd


def test_plans_asking_for_exact_reuse_are_not_restored(deep_llama):
    eng, rnd = _stored_round(deep_llama)
    ids, segments = rnd.prompt(0, method="dense")
    eng.generate(ids + [5, 6], SamplingParams(max_tokens=1), segments=segments, publish=False)
    eng.generate(ids + [5, 7], SamplingParams(max_tokens=1), publish=False)  # no plan at all
    assert eng.lifecycle.restorer.num_restores == 0
    assert eng.diff_store.read(ids) is not None  # it was there to restore


def test_an_evicted_master_takes_its_mirrors_with_it(deep_llama):
    eng = engine(deep_llama)
    rc = RoundCaches(eng, Round.make(num_agents=3))
    store = eng.diff_store
    store.store_round(rc.images, rc.plan.master)
    master = rc.images[rc.plan.master]
    store.blobs.discard(store._stored[store._key(master.token_ids)].blob)  # as if the LRU had evicted it
    assert store.read(master.token_ids) is None
    assert store._stored == {} and all(not lengths for lengths in store._lengths.values())
    sibling = rc.images[(rc.plan.master + 1) % 3]
    assert store.match(list(sibling.token_ids) + [5], sibling.region_start) is None


def test_a_segment_asking_for_the_default_dense_method_is_not_restored(deep_llama):
    eng, rnd = _stored_round(deep_llama)
    eng.lifecycle.restorer.default_method = "dense"  # as if the engine ran with --reuse-method dense
    ids, segments = rnd.prompt(1, method=None)
    eng.generate(ids + [5, 6], SamplingParams(max_tokens=1), segments=segments, publish=False)
    assert eng.lifecycle.restorer.num_restores == 0 and eng.diff_store.read(ids) is not None


def test_rounds_under_memory_pressure_never_leak_or_fail(deep_llama):
    """Several rounds whose prompts extend the last ones (restores), with a pool too small
    for everything: caches are evicted, requests preempted; all finish, nothing stays pinned."""
    eng = engine(deep_llama, num_blocks=56)  # 896 tokens of KV in all
    rnd = Round.make(num_agents=3, output_len=24)
    rnd.cache_outputs(eng)
    prompts = [rnd.prompt(i) for i in range(3)]
    for turn in range(4):
        seqs = []
        for i, (ids, segments) in enumerate(prompts):
            info = RoundInfo(id=f"turn-{turn}", size=3, index=i)
            seqs.append(eng.add_request(EngineRequest(f"t{turn}-{i}", ids, SamplingParams(max_tokens=6, temperature=0.0),
                                        segments=segments, scope=ReuseScope("app", f"agent{i}", info))))
        run_all(eng)
        assert all(s.is_finished and s.finish_reason == "length" for s in seqs)
        assert eng.kv.pool.num_free == eng.kv.pool.num_blocks  # nothing pinned between turns
        # Each agent's next prompt extends its last one: its own round cache is restored.
        prompts = [(s.token_ids + tokens(4, 10 * turn + i), segments)
                   for i, (s, (_, segments)) in enumerate(zip(seqs, prompts))]
    assert eng.lifecycle.restorer.num_restores > 0 and eng.kv.pool.num_evictions > 0


def test_each_turn_is_stored_so_the_next_restores_all_of_it(deep_llama):
    eng, rnd = _stored_round(deep_llama)
    ids, segments = rnd.prompt(1)
    turn1 = ids + tokens(6, 61)
    first = eng.generate(turn1, SamplingParams(max_tokens=1), segments=segments)
    assert first.num_cached_tokens == len(ids)  # the round's cache
    turn2 = turn1 + tokens(6, 62)
    second = eng.generate(turn2, SamplingParams(max_tokens=1), segments=segments)
    assert second.num_cached_tokens == len(turn1)  # turn 1's own cache, a mirror of the round's master
    store = eng.diff_store
    round_caches = [store._stored[store._key(rnd.prompt(i)[0])] for i in range(3)]
    (master,) = [c for c in round_caches if type(c).__name__ == "StoredMaster"]
    stored = store._stored[store._key(turn1)]
    assert type(stored).__name__ == "StoredMirror" and stored.master is master
    assert stored.diff.num_tokens < len(turn1) - stored.region_start  # the restored part is the master's
    assert eng.lifecycle.restorer.num_restores == 2


def test_a_tenant_neither_restores_nor_mirrors_another_tenants_round(deep_llama):
    eng = engine(deep_llama)
    rc = RoundCaches(eng, Round.make(num_agents=3))
    store = eng.diff_store
    store.store_round(rc.images, rc.plan.master)  # the default tenant's round
    image = rc.images[1]
    assert store.read(image.token_ids) is not None
    assert store.read(image.token_ids, "team-b") is None
    assert store.match(list(image.token_ids) + [5], image.region_start, "team-b") is None
    # Tenant b's own copy of the same prompt is a master of its own, never a mirror of the default's.
    kept = store.store(image._replace(tenant="team-b"))
    assert kept is not None and kept.tenant == "team-b" and not hasattr(kept, "master")
    assert store.read(image.token_ids, "team-b") is not None
