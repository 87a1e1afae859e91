"""TokenDance (engine side): collective reuse of an All-Gather round's shared segments.

The KVCollector groups a round's waiting requests; CollectivePrefill shifts their
segments in one batched pass, selects the positions to recompute once for the round,
and lets a Recovery method refresh them per request in one batched forward. Its
CollectivePlan names the master the DiffStore (engine_ext/diffs) keeps the round against.
"""

from engine_ext.collective.collector import CollectiveGroup, KVCollector
from engine_ext.collective.plan import CollectivePlan
from engine_ext.collective.prefill import CollectivePrefill, CollectiveResult, GroupMember
from engine_ext.collective.recovery import RECOVERIES, BlendRecovery, Recovery, RecoveryResult
from engine_ext.collective.rows import PromptRows, RowsForward, RowsResult

__all__ = ["RECOVERIES", "BlendRecovery", "CollectiveGroup", "CollectivePlan", "CollectivePrefill",
           "CollectiveResult", "GroupMember", "KVCollector", "PromptRows", "Recovery", "RecoveryResult",
           "RowsForward", "RowsResult"]
