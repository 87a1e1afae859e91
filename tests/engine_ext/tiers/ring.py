"""Three out-of-phase sessions of one 6-agent ring, and the ground-truth check of KVFlow
per session: after each request, is every session's next agent within load_ahead?

The sessions take turns (s0, s1, s2, s0, ...), each two agents ahead of the one before,
so at any time they need three different agents. A session's next agent comes from this
script (where the session stands), never from the policy's prediction. The first rounds
are not counted: until every agent has run once its fixed prefix is unknown, and nothing
could load it ahead.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

NUM_AGENTS = 6
AGENTS = tuple(f"agent{i}" for i in range(NUM_AGENTS))
PHASES = (0, 2, 4)  # where each session starts in the ring
LOAD_AHEAD = 2
WARM_ROUNDS = 2  # with these phases, every agent has run once after two rounds
ROUNDS = 16  # counted: 16 rounds x 3 requests x 3 sessions = 144 checks


def ring_steps(agent: int) -> dict[str, int]:
    """What the gateway's step graph plans for a request of `agent` in a ring: its own
    session's steps-to-execution, the requesting agent at 0."""
    return {AGENTS[(agent + k) % NUM_AGENTS]: k for k in range(NUM_AGENTS)}


def replay(run: Callable[[int, int], None], due: Callable[[], Collection[str]]) -> tuple[int, int]:
    """`run(session, agent)` serves one request to completion; `due()` names the agents
    ranked within load_ahead (prefetch-eligible) now. Returns (checks passed, checks)."""
    position = list(PHASES)
    passed = checks = 0
    for round_index in range(WARM_ROUNDS + ROUNDS):
        for session in range(len(PHASES)):
            run(session, position[session] % NUM_AGENTS)
            position[session] += 1
            if round_index < WARM_ROUNDS:
                continue
            due_now = due()
            for p in position:
                checks += 1
                passed += AGENTS[p % NUM_AGENTS] in due_now
    return passed, checks
