"""KVFlow by default: TierConfig's automatic values and the host tier sized from memory at engine start."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from engine_ext.config import DEFAULT_LOAD_AHEAD, EngineConfig, TierConfig
from engine_ext.tiers.sizing import auto_host_bytes, available_memory_bytes, with_sized_host_tier
from tests.helpers import TINY_BLOCK_BYTES, make_engine

MIB = 2**20


def test_the_defaults_are_kvflow() -> None:
    tiers = TierConfig()
    assert DEFAULT_LOAD_AHEAD == 2  # KVFlow's
    assert (tiers.policy, tiers.host_bytes, tiers.load_ahead) == ("workflow", None, DEFAULT_LOAD_AHEAD)
    assert tiers.has_lower_tier  # the automatic host tier counts


@pytest.mark.parametrize(("kwargs", "load_ahead"), [
    ({"policy": "lru"}, 0),  # prefetching needs the workflow policy
    ({"host_bytes": 0}, 0),  # and something to load from
    ({"host_bytes": 0, "disk_path": "/tmp/kv", "disk_bytes": MIB}, 2),
    ({"host_bytes": MIB}, 2),
    ({"load_ahead": 5}, 5),  # an explicit value is kept
    ({"policy": "lru", "host_bytes": 0, "load_ahead": 0}, 0),
])
def test_automatic_load_ahead(kwargs: dict, load_ahead: int) -> None:
    assert TierConfig(**kwargs).load_ahead == load_ahead


def test_auto_host_bytes_is_twice_the_device_capped_by_a_quarter_of_available_memory() -> None:
    block = 3000
    assert auto_host_bytes(100 * MIB, 10_000 * MIB, block) == 200 * MIB // block * block
    assert auto_host_bytes(100 * MIB, 400 * MIB, block) == 100 * MIB // block * block  # a quarter of 400
    assert auto_host_bytes(100 * MIB, 1000, block) == 0  # less than a block
    assert auto_host_bytes(100 * MIB, None, block) == 0  # unknown: no guess


def _config(**tiers) -> EngineConfig:
    return EngineConfig(kv_cache_bytes=64 * TINY_BLOCK_BYTES, tiers=TierConfig(**tiers))


def test_with_sized_host_tier_sizes_only_the_automatic_tier() -> None:
    sized = with_sized_host_tier(_config(), TINY_BLOCK_BYTES, available=lambda: 2**40)
    assert sized.tiers.host_bytes == 128 * TINY_BLOCK_BYTES and sized.tiers.load_ahead == 2
    explicit = _config(host_bytes=0, policy="lru")
    assert with_sized_host_tier(explicit, TINY_BLOCK_BYTES, available=lambda: 2**40) is explicit


def test_no_readable_memory_turns_the_host_tier_and_prefetching_off(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="engine_ext.tiers.sizing"):
        sized = with_sized_host_tier(_config(), TINY_BLOCK_BYTES, available=lambda: None)
    assert (sized.tiers.host_bytes, sized.tiers.load_ahead, sized.tiers.has_lower_tier) == (0, 0, False)
    assert "could not be read" in caplog.text
    with_disk = with_sized_host_tier(_config(disk_path="/tmp/kv", disk_bytes=MIB), TINY_BLOCK_BYTES,
                                     available=lambda: None)
    assert (with_disk.tiers.host_bytes, with_disk.tiers.load_ahead) == (0, 2)  # the disk tier is still there


def test_available_memory_reads_mem_available(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       32000000 kB\nMemFree:         1000 kB\nMemAvailable:   20000000 kB\n")
    assert available_memory_bytes(meminfo) == 20_000_000 * 1024
    fallback = available_memory_bytes(tmp_path / "missing")  # sysconf's free pages, where there is one
    assert fallback is None or fallback > 0


def test_an_engine_with_default_tiers_runs_kvflow(tiny_model_dir) -> None:
    engine = make_engine(tiny_model_dir("llama"), num_blocks=64)
    try:
        tiers = engine.config.tiers
        assert tiers.policy == "workflow" and tiers.load_ahead == 2
        assert tiers.host_bytes == 128 * TINY_BLOCK_BYTES  # twice the device: far below a quarter of memory
        assert engine.tiers is not None and engine.tiers.tiers[0].num_blocks == 128
        assert engine.prefetcher is not None
    finally:
        engine.close()


def test_every_part_of_an_engine_holds_its_one_sized_config(tiny_model_dir) -> None:
    """The automatic host tier is sized before any part takes the config: the scheduler,
    the reuse lifecycle and its parts read the very object the engine reports."""
    engine = make_engine(tiny_model_dir("llama"), num_blocks=64)
    try:
        assert engine.config.tiers.host_bytes == 128 * TINY_BLOCK_BYTES
        assert engine.scheduler.config is engine.config and engine.lifecycle.config is engine.config
        assert engine.collector is not None and engine.collector.config is engine.config.reuse.collective
    finally:
        engine.close()
