"""Dominators: equal to the definition (every path from the root passes through) on
random small graphs, cheap on long chains (no recursion, near-linear work), and stopped
by a passed deadline."""

from __future__ import annotations

import random

import pytest

from kvrelay.gateway.inference.budget import Deadline, OutOfTime
from kvrelay.gateway.inference.dominators import Dominators
from tests.helpers import LINEAR_RATIO_BOUND, cpu_ratio


def _reachable(successors: dict[int, set[int]], root: int, removed: int | None) -> set[int]:
    if root == removed:
        return set()
    seen, todo = {root}, [root]
    while todo:
        for nxt in successors[todo.pop()]:
            if nxt != removed and nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def _graph(rng: random.Random, n: int, num_edges: int) -> tuple[dict[int, set[int]], dict[int, set[int]]]:
    successors: dict[int, set[int]] = {i: set() for i in range(n)}
    for _ in range(num_edges):
        successors[rng.randrange(n)].add(rng.randrange(n))
    predecessors: dict[int, set[int]] = {i: set() for i in range(n)}
    for a, targets in successors.items():
        for b in targets:
            predecessors[b].add(a)
    return successors, predecessors


def test_dominance_is_every_path_passing_through_on_random_graphs():
    rng = random.Random(7)
    for _ in range(1500):
        n = rng.randrange(1, 9)
        successors, predecessors = _graph(rng, n, rng.randrange(0, 3 * n))
        tree = Dominators(0, successors, predecessors)
        reachable = _reachable(successors, 0, None)
        for a in range(n):
            without_a = _reachable(successors, 0, a)
            for b in range(n):
                expected = a in reachable and b in reachable and b not in without_a
                assert tree.dominates(a, b) == expected, (successors, a, b)
            assert tree.reachable(a) == (a in reachable)


def test_a_long_chain_needs_no_recursion_and_costs_linear_time():
    def chain(n: int) -> tuple[dict[int, set[int]], dict[int, set[int]]]:
        successors = {i: {i + 1} for i in range(n - 1)} | {n - 1: {0}}
        return successors, {i: {(i - 1) % n} for i in range(n)}

    small, large = chain(5_000), chain(20_000)
    tree = Dominators(0, *large)
    assert tree.dominates(10, 19_999) and not tree.dominates(19_999, 10)
    ratio = cpu_ratio(lambda: Dominators(0, *small), lambda: Dominators(0, *large))
    assert ratio < LINEAR_RATIO_BOUND, f"4x the nodes took {ratio:.1f}x the time"


def test_a_passed_deadline_stops_the_work():
    successors = {i: {i + 1} for i in range(4_999)} | {4_999: set()}
    predecessors = {i: {i - 1} for i in range(1, 5_000)} | {0: set()}
    with pytest.raises(OutOfTime):
        Dominators(0, successors, predecessors, Deadline(0.0))
