"""Prefetcher: bring back the fixed prefixes of the agents due next, before they are asked for.

Each engine step, the agents at most `load_ahead` steps from running (every branch of a
conditional counts: the step graph gives each possible next agent its steps) have the
blocks of their prefix that left the device loaded back from the lower tiers, soonest
agent first, with at most `max_prefetches` loads in flight. A load takes only free
blocks the workflow policy would give up for that agent (never a nearer agent's
prefix) and leaves free the blocks running requests still need to finish, so
prefetching never preempts one. The copies run on the transfer worker while the model computes.
"""

from __future__ import annotations

from functools import partial

from engine_ext.kv.eviction import EvictionPolicy
from engine_ext.tiers.store import TieredStore
from engine_ext.tiers.workflow import UpcomingAgent, WorkflowTable


class Prefetcher:
    def __init__(self, table: WorkflowTable, store: TieredStore, policy: EvictionPolicy,
                 load_ahead: int, max_prefetches: int) -> None:
        self.table = table
        self.store = store
        self.policy = policy
        self.load_ahead = load_ahead
        self.max_prefetches = max_prefetches
        self.num_started = 0  # loads started (one per agent prefix that needed one)

    def due(self) -> list[UpcomingAgent]:
        """The agents within `load_ahead` steps of running, soonest first."""
        return self.table.upcoming(self.load_ahead)

    def run(self, due: list[UpcomingAgent], num_reserved: int) -> int:
        """Start the loads the `due` agents need, leaving `num_reserved` blocks free (those
        the running requests may still allocate: the scheduler's figure, which the engine
        asks for only when some agent is due); returns how many blocks it started."""
        num_blocks = 0
        for upcoming in due:
            if self.store.num_loads_in_flight >= self.max_prefetches:
                break
            started = self.store.load(upcoming.prefix, partial(self.policy.spares, steps=upcoming.steps),
                                      num_reserved)
            if started:
                self.num_started += 1
                num_blocks += started
        return num_blocks
