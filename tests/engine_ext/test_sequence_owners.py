"""Each field of a `Sequence` has one owner: the modules that assign it, read from the
source. A second writer elsewhere (the engine bumping a count the KV manager keeps, the
scheduler setting what reuse reports) is the back-edge this guards against."""

from __future__ import annotations

import ast
import dataclasses
from collections import defaultdict
from pathlib import Path

import engine_ext.engine  # noqa: F401  (imports the package in the order it loads in)
from engine_ext.sequence import Sequence

ROOT = Path(engine_ext.engine.__file__).parent
# Field -> the modules (relative to engine_ext/) of the one part that owns it.
OWNERS = {
    "num_computed_tokens": {"kv/manager.py"},  # a fact about its blocks
    "blocks": {"kv/manager.py"},
    "num_published_blocks": {"kv/manager.py"},
    "block_hashes": {"kv/manager.py"},
    "status": {"scheduler.py"},
    "finish_reason": {"scheduler.py"},
    "num_preemptions": {"scheduler.py"},
    # The reuse lifecycle and the parts it drives (keeper, collector).
    "num_cached_tokens": {"reuse/lifecycle.py", "reuse/keep.py"},
    "num_fetched_tokens": {"reuse/lifecycle.py"},
    "assembly": {"reuse/lifecycle.py", "reuse/keep.py"},
    "group": {"reuse/lifecycle.py", "collective/collector.py"},
    "restore": {"reuse/lifecycle.py"},
    "num_exact_tokens": {"reuse/lifecycle.py"},
    "reuse_outcomes": {"reuse/keep.py"},
    # Teacher forcing: set by whoever submits the request, before its first step (the
    # engine's generate/score helpers, the fidelity probes); the runner only appends.
    "forced_token_ids": {"engine.py", "probes.py"},
    "logits": {"engine.py", "probes.py"},
}
# Attribute names other records share with Sequence: their writers are not Sequence's.
NOT_SEQUENCE = {"blocks": {"kv/block_pool.py", "tiers/storage.py"}, "segments": {"vllm/copier.py", "vllm/planner.py"},
                "num_preemptions": {"probes.py"}}


def writers() -> dict[str, set[str]]:
    fields = {f.name for f in dataclasses.fields(Sequence)}
    found: dict[str, set[str]] = defaultdict(set)
    for path in ROOT.rglob("*.py"):
        module = path.relative_to(ROOT).as_posix()
        if module == "sequence.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and node.attr in fields:
                found[node.attr].add(module)
    return found


def test_each_owned_field_is_written_by_its_owner_alone():
    found = writers()
    for field, owner in OWNERS.items():
        stray = found.get(field, set()) - owner - NOT_SEQUENCE.get(field, set())
        assert not stray, f"Sequence.{field} is owned by {sorted(owner)} but also written in {sorted(stray)}"


def test_no_field_has_writers_in_two_parts_unless_owned():
    """A field not in OWNERS has at most one writing module (a new field gets one owner)."""
    for field, modules in writers().items():
        if field not in OWNERS:
            assert len(modules - NOT_SEQUENCE.get(field, set())) <= 1, (field, sorted(modules))
