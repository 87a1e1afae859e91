"""ConnectorConfig: the connector's settings, from kv_connector_extra_config."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any

from engine_ext.vllm.index import TierName


@dataclass(frozen=True)
class ConnectorConfig:
    """`host_dir` should be on tmpfs (it stands for pinned host memory), `disk_dir` on a
    disk. Both default to directories named by the replica's engine id, so two replicas
    never share one; set them (one pair per replica) to keep the disk tier across
    restarts. A zero budget turns a tier off; at least one must be on."""

    host_dir: str
    disk_dir: str
    host_mb: float = 1024.0
    disk_mb: float = 4096.0
    load_ahead: int = 2  # KVFlow: prefetch the prefixes of agents at most this many steps away
    max_promotions_per_step: int = 8  # disk -> host moves started per scheduler step
    workflow_idle_s: float = 600.0  # an app silent this long stops holding its prefixes
    async_loads: bool = True  # a request waits for its blocks without holding up the others' steps
    device_order: bool = True  # KVFlow's order over vLLM's own free queue (engine_ext/vllm/device.py)
    segment_mb: float = 512.0  # opted-in apps' reusable answers (engine_ext/vllm/segment_plan.py); 0: off
    blend_ratio: float = 0.15  # blend: the share of a placed segment's tokens recomputed (CacheBlend)
    check_layer: int = 1  # blend: the layer whose key deviation picks them
    private_host_dir: bool = False  # host_dir is this engine's own (the default): removed at shutdown

    def __post_init__(self) -> None:
        if self.host_mb < 0 or self.disk_mb < 0 or self.segment_mb < 0:
            raise ValueError("kvrelay connector: host_mb, disk_mb and segment_mb must be >= 0")
        if self.host_mb == 0 and self.disk_mb == 0:
            raise ValueError("kvrelay connector: host_mb and disk_mb are both 0: no tier to keep KV in")
        if self.load_ahead < 0 or self.max_promotions_per_step < 0:
            raise ValueError("kvrelay connector: load_ahead and max_promotions_per_step must be >= 0")
        if not 0.0 <= self.blend_ratio <= 1.0 or self.check_layer < 0:
            raise ValueError("kvrelay connector: blend_ratio must be in [0, 1] and check_layer >= 0")
        if self.workflow_idle_s <= 0:
            raise ValueError("kvrelay connector: workflow_idle_s must be > 0")

    def shard_dirs(self, rank: int, world_size: int) -> dict[TierName, str]:
        """The tiers' directories of one tensor-parallel worker. Each worker holds its own
        KV heads of every block, so each keeps its own shard files, in its own
        subdirectory; a block is a hit only where every worker holds its shard (a missing
        one fails that worker's load, and vLLM recomputes the block)."""
        if world_size == 1:
            return {"host": self.host_dir, "disk": self.disk_dir}
        shard = f"tp{rank}-of-{world_size}"
        return {"host": os.path.join(self.host_dir, shard), "disk": os.path.join(self.disk_dir, shard)}

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None, engine_id: str) -> ConnectorConfig:
        """Settings from kv_connector_extra_config; unknown keys and wrong types are errors."""
        extra = dict(extra or {})
        # Each field's type as this module spells it (a string: its annotations are postponed).
        known = {f.name: str(f.type) for f in fields(cls) if f.name != "private_host_dir"}
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise ValueError(f"kvrelay connector: unknown kv_connector_extra_config keys {unknown}; "
                             f"known: {sorted(known)}")
        values: dict[str, Any] = {
            "host_dir": os.path.join("/dev/shm", f"kvrelay-{engine_id}"),
            "disk_dir": os.path.join(os.environ.get("TMPDIR", "/tmp"), f"kvrelay-kv-{engine_id}"),
        }
        for key, value in extra.items():
            values[key] = _coerce(key, known[key], value)
        return cls(**values, private_host_dir="host_dir" not in extra)


def _coerce(key: str, annotation: str, value: Any) -> Any:
    kinds: dict[str, type[Any] | tuple[type[Any], ...]] = {"str": str, "float": (int, float), "int": int, "bool": bool}
    if (isinstance(value, bool) and annotation != "bool") or not isinstance(value, kinds[annotation]):
        raise ValueError(f"kvrelay connector: {key} must be a {annotation}, got {value!r}")
    return float(value) if annotation == "float" else value
