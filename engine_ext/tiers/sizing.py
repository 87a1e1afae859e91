"""The automatic host KV tier: KVFlow is on by default, so a host tier must exist without
the operator sizing one.

Rule: twice the device tier (`kv_cache_bytes`), at most a quarter of the memory the
machine has available when the engine starts (MemAvailable), in whole KV blocks. Twice the
device: the tier is write-through (it also holds copies of what the device holds), so
only what exceeds the device's size is extra room for evicted prefixes; one device's
worth of it keeps every prefix the device lets go for as long again. A quarter of what
is available: the model, the gateway, the OS page cache and other processes keep the
rest. The tensor is allocated, not touched: pages become resident as blocks are backed
up, so RSS grows to the tier's size only under a workload with that many distinct
prefixes. When the available memory cannot be read the tier is off (no guess).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from pathlib import Path

from engine_ext.config import EngineConfig

logger = logging.getLogger(__name__)

DEVICE_MULTIPLE = 2  # host tier / device tier
MEMORY_FRACTION = 0.25  # host tier / memory available at start
MEMINFO = Path("/proc/meminfo")


def available_memory_bytes(meminfo: Path = MEMINFO) -> int | None:
    """The memory available to new allocations without swapping (Linux's MemAvailable),
    else free physical pages (other POSIX systems); None when neither can be read."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError) as exc:
        logger.debug("cannot read %s: %s", meminfo, exc)
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def auto_host_bytes(device_bytes: int, available: int | None, block_bytes: int) -> int:
    """The automatic host tier's size in bytes, in whole blocks (0: none)."""
    if available is None:
        return 0
    limit = min(DEVICE_MULTIPLE * device_bytes, int(MEMORY_FRACTION * available))
    return limit // block_bytes * block_bytes


def with_sized_host_tier(config: EngineConfig, block_bytes: int,
                         available: Callable[[], int | None] = available_memory_bytes) -> EngineConfig:
    """`config` with its automatic host tier (tiers.host_bytes None) given a size;
    `block_bytes` is one KV block's size. An explicit size, 0 included, is kept. With no
    lower tier after all, prefetching is off (there is nothing to load from)."""
    tiers = config.tiers
    if tiers.host_bytes is not None:
        return config
    memory = available()
    num_bytes = auto_host_bytes(config.kv_cache_bytes, memory, block_bytes)
    load_ahead = tiers.load_ahead if num_bytes or tiers.disk_path is not None else 0
    if num_bytes:  # debug: a command's output stays its own (a refusal is one line)
        logger.debug("host KV tier: %.1f MiB (automatic: %dx the device tier, at most %d%% of available memory)",
                    num_bytes / 2**20, DEVICE_MULTIPLE, round(100 * MEMORY_FRACTION))
    elif memory is None:
        logger.warning("host KV tier off: the available memory could not be read")
    else:
        logger.warning("host KV tier off: %d bytes available hold no KV block", memory)
    return dataclasses.replace(config, tiers=dataclasses.replace(tiers, host_bytes=num_bytes, load_ahead=load_ahead))
