"""BlockFiles and BlockCopier: blocks round-trip between a paged cache and the tiers in
either cache layout; a missing or wrong-sized file is a failed load, never wrong KV."""

from __future__ import annotations

import logging

import pytest
import torch

from engine_ext.vllm.copier import BlockCopier
from engine_ext.vllm.files import BlockFileError, BlockFiles
from engine_ext.vllm.index import BlockLoad, BlockMove, BlockSave

NUM_BLOCKS = 6


def h(i: int) -> bytes:
    return bytes([i]) * 16


@pytest.fixture
def tiers(tmp_path):
    return {"host": BlockFiles(tmp_path / "host"), "disk": BlockFiles(tmp_path / "disk")}


def caches(layout: str, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, 2, 4, 16) if layout == "cpu" else (2, NUM_BLOCKS, 4, 2, 8)
    return {f"layer{i}": torch.randn(shape, generator=gen) for i in range(3)}


@pytest.mark.parametrize("layout", ["cpu", "gpu"])
def test_saved_blocks_load_into_other_blocks_bit_for_bit(tiers, layout):
    source, target = caches(layout, 0), caches(layout, 1)
    saver, loader = BlockCopier(tiers), BlockCopier(tiers)
    saver.register(source, NUM_BLOCKS)
    loader.register(target, NUM_BLOCKS)
    saver.save_and_move([BlockSave(h(1), "host", 2, "r"), BlockSave(h(2), "host", 4, "r"), BlockMove(h(2), "host", "disk")])
    saver.drain()
    assert loader.load([BlockLoad(h(1), "host", 0, "r"), BlockLoad(h(2), "disk", 5, "r")]) == set()
    dim = 0 if layout == "cpu" else 1
    for name in source:
        assert torch.equal(target[name].select(dim, 0), source[name].select(dim, 2))
        assert torch.equal(target[name].select(dim, 5), source[name].select(dim, 4))
    assert not tiers["host"].path(h(2)).exists()
    saver.close()
    loader.close()


def test_missing_or_cut_files_fail_their_blocks_only(tiers, caplog):
    cache = caches("cpu", 0)
    copier = BlockCopier(tiers)
    copier.register(cache, NUM_BLOCKS)
    copier.save_and_move([BlockSave(h(1), "host", 1, "r"), BlockSave(h(2), "host", 2, "r")])
    copier.drain()
    tiers["host"].path(h(2)).write_bytes(b"short")
    before = cache["layer0"].clone()
    with caplog.at_level(logging.WARNING):
        failed = copier.load([BlockLoad(h(1), "host", 3, "r"), BlockLoad(h(2), "host", 4, "r"), BlockLoad(h(3), "disk", 5, "r")])
    assert failed == {4, 5}
    assert torch.equal(cache["layer0"][4], before[4]) and torch.equal(cache["layer0"][3], before[1])
    assert "recomputing a block" in caplog.text
    copier.close()


def test_a_failed_move_is_logged_not_raised(tiers, caplog):
    copier = BlockCopier(tiers)
    copier.register(caches("cpu", 0), NUM_BLOCKS)
    with caplog.at_level(logging.WARNING):
        copier.save_and_move([BlockMove(h(9), "host", "disk")])
        copier.drain()
    assert "KV file operation failed" in caplog.text
    copier.close()


def test_files_listing_and_wrong_layouts(tiers):
    tiers["disk"].write(h(1), torch.zeros(4))
    (tiers["disk"].directory / "notes.txt").write_text("not a block")
    assert tiers["disk"].hashes() == [h(1)]
    with pytest.raises(BlockFileError, match="has 16 bytes, expected 32"):
        tiers["disk"].read(h(1), (8,), torch.float32)
    with pytest.raises(ValueError, match="no block dimension of size 7"):
        BlockCopier(tiers).register(caches("cpu", 0), 7)


def test_a_request_whose_load_failed_saves_nothing_more(tiers):
    copier = BlockCopier(tiers)
    copier.register(caches("cpu", 0), NUM_BLOCKS)
    assert copier.load([BlockLoad(h(1), "host", 0, "bad")]) == {0}
    copier.save_and_move([BlockSave(h(2), "host", 1, "bad"), BlockSave(h(3), "host", 2, "good")])
    copier.drain()
    assert not tiers["host"].path(h(2)).exists() and tiers["host"].path(h(3)).exists()
    copier.close()


def test_asynchronous_loads_report_each_request_once_with_its_failed_blocks(tiers):
    source, target = caches("cpu", 0), caches("cpu", 1)
    saver, loader = BlockCopier(tiers), BlockCopier(tiers)
    saver.register(source, NUM_BLOCKS)
    loader.register(target, NUM_BLOCKS)
    saver.save_and_move([BlockSave(h(1), "host", 2, "w"), BlockSave(h(2), "host", 3, "w")])
    saver.drain()
    before = target["layer0"].clone()
    loader.load_async([BlockLoad(h(1), "host", 0, "ok"), BlockLoad(h(2), "host", 1, "ok"),
                       BlockLoad(h(1), "host", 4, "half"), BlockLoad(h(7), "disk", 5, "half")])
    loader.drain()  # the loads ran on the copier's thread, behind nothing else
    done, failed = loader.finished_loads()
    assert done == {"ok", "half"} and failed == {5}
    assert loader.finished_loads() == (set(), set())  # reported once
    for name in source:
        assert torch.equal(target[name][0], source[name][2]) and torch.equal(target[name][1], source[name][3])
        assert torch.equal(target[name][4], source[name][2])
    assert torch.equal(target["layer0"][5], before[5])  # a failed block is left as it was, and recomputed
    saver.close()
    loader.close()


def test_an_asynchronous_load_waits_for_the_write_issued_before_it(tiers):
    source = caches("cpu", 0)
    copier = BlockCopier(tiers)
    copier.register(source, NUM_BLOCKS)
    copier.save_and_move([BlockSave(h(1), "host", 2, "w"), BlockMove(h(1), "host", "disk")])
    copier.load_async([BlockLoad(h(1), "disk", 5, "r")])  # no drain in between
    copier.drain()
    assert copier.finished_loads() == ({"r"}, set())
    assert torch.equal(source["layer1"][5], source["layer1"][2])
    copier.close()


def test_a_held_request_is_released_once_its_answer_is_copied_and_vllm_named_it_finished(tiers, llama_dir):
    from engine_ext.vllm.segment_plan import SegmentSave
    from engine_ext.vllm.segment_worker import SegmentWorker

    segments = SegmentWorker(BlockFiles(tiers["host"].directory / "segments"), llama_dir)
    copier = BlockCopier(tiers, segments)
    cfg = segments.config
    copier.register({f"l{i}": torch.randn(NUM_BLOCKS, cfg.num_kv_heads, 4, 2 * cfg.head_dim)
                     for i in range(cfg.num_layers)}, NUM_BLOCKS)
    copier.save_and_move([SegmentSave(h(1), [2, 3], 1, 6, "held", hold=True),
                          SegmentSave(h(2), [4], 0, 3, "running")])  # a harvest: its request runs on
    assert copier.released(set()) == set()  # not named finished yet: vLLM must not free it
    assert copier.released({"held", "running", "other"}) == {"held"}
    assert copier.released({"held"}) == set()  # once
    copier.drain()
    assert segments.files.path(h(1)).stat().st_size == 2 * cfg.num_layers * 5 * cfg.num_kv_heads * cfg.head_dim * 4
    copier.close()
