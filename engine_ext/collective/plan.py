"""CollectivePlan: what one collective prefill decided, for the report and for storage.

TokenDance's reuse plan is the bridge between collective reuse and diff-aware storage:
it names the group, each member's deviation from the shared cached blocks, and the
master (the member with the lowest deviation), whose cache the others are stored
against. It also holds the positions every member recomputed, per shared segment.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch


class CollectivePlan(NamedTuple):
    round_id: str
    request_ids: list[str]
    deviations: list[float]  # per member: summed key deviation of its recomputed positions
    master: int  # index of the member with the lowest deviation
    selected: dict[bytes, torch.Tensor]  # segment key -> offsets recomputed (sorted), same for every member
    num_candidates: int  # placed tokens of the probe
    num_selected: int  # of those, how many every member recomputes
    recompute_ratios: list[float]  # per member: its recomputed placed tokens over its placed tokens
    reused_selection: bool  # the offsets came from an earlier group of the round (no deviation pass)

    @property
    def size(self) -> int:
        return len(self.request_ids)

    def report(self, member: int) -> dict[str, Any]:
        """What a member's response says about its group (under each collective segment).
        A request alone (a late member of its round) has no master in its group."""
        out: dict[str, Any] = {
            "round": self.round_id,
            "group_size": self.size,
            "selection": "round" if self.reused_selection else "probe",
            "deviation": round(self.deviations[member], 4),
            "recompute_ratio": round(self.recompute_ratios[member], 4),
        }
        if self.size > 1:
            out["master"] = self.request_ids[self.master]
            out["is_master"] = member == self.master
        return out


def lowest(deviations: list[float]) -> int:
    """The master: lowest total deviation; ties go to the earliest member."""
    return min(range(len(deviations)), key=lambda i: (deviations[i], i))
