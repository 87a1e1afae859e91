"""Dominators: which nodes every path from a root passes through.

Node X dominates node p when every path from the root to p passes through X. The step
graph asks it for AND agents: an AND agent waits only for the predecessors that can
still run before it, those reachable from the current agent without passing through the
AND agent itself, that is, those it does not dominate.

Lengauer and Tarjan's algorithm (the simple version, with path compression), iterative
so that long chains do not reach Python's recursion limit: O(E log V) for the nodes
reachable from the root. A dominance query is then two comparisons of the dominator
tree's ranges. The work looks at the deadline every CHECK_EVERY nodes and stops with
OutOfTime once it has passed.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Mapping
from typing import Generic, TypeVar

from kvrelay.gateway.inference.budget import NO_DEADLINE, Deadline

Node = TypeVar("Node", bound=Hashable)
CHECK_EVERY = 256


class Dominators(Generic[Node]):
    def __init__(self, root: Node, successors: Mapping[Node, Collection[Node]],
                 predecessors: Mapping[Node, Collection[Node]], deadline: Deadline = NO_DEADLINE) -> None:
        order, number, parent = _depth_first(root, successors, deadline)
        self._number = number
        idom = _immediate_dominators(order, number, parent, predecessors, deadline)
        self._enter, self._leave = _intervals(idom)

    def reachable(self, node: Node) -> bool:
        return node in self._number

    def dominates(self, a: Node, b: Node) -> bool:
        """Every path from the root to `b` passes through `a` (a node dominates itself);
        False when either is unreachable."""
        i, j = self._number.get(a), self._number.get(b)
        if i is None or j is None:
            return False
        return self._enter[i] <= self._enter[j] < self._leave[i]


def _depth_first(root: Node, successors: Mapping[Node, Collection[Node]],
                 deadline: Deadline) -> tuple[list[Node], dict[Node, int], list[int]]:
    """Nodes in DFS preorder, their numbers, and each one's DFS-tree parent (by number)."""
    order, number, parent = [root], {root: 0}, [-1]
    stack = [(0, iter(successors.get(root, ())))]
    while stack:
        at, rest = stack[-1]
        for nxt in rest:
            if nxt not in number:
                if len(order) % CHECK_EVERY == 0:
                    deadline.check()
                number[nxt] = len(order)
                order.append(nxt)
                parent.append(at)
                stack.append((number[nxt], iter(successors.get(nxt, ()))))
                break
        else:
            stack.pop()
    return order, number, parent


def _immediate_dominators(order: list[Node], number: dict[Node, int], parent: list[int],
                          predecessors: Mapping[Node, Collection[Node]], deadline: Deadline) -> list[int]:
    n = len(order)
    semi = list(range(n))
    idom = [0] * n
    ancestor = [-1] * n
    label = list(range(n))
    bucket: list[list[int]] = [[] for _ in range(n)]

    def evaluate(v: int) -> int:
        if ancestor[v] == -1:
            return v
        path = []
        while ancestor[ancestor[v]] != -1:
            path.append(v)
            v = ancestor[v]
        for u in reversed(path):  # compress, the node nearest the forest root first
            a = ancestor[u]
            if semi[label[a]] < semi[label[u]]:
                label[u] = label[a]
            ancestor[u] = ancestor[a]
        return label[path[0]] if path else label[v]

    for w in range(n - 1, 0, -1):
        if w % CHECK_EVERY == 0:
            deadline.check()
        best = semi[w]
        for pred in predecessors.get(order[w], ()):
            v = number.get(pred)
            if v is None:
                continue  # unreachable from the root
            if ancestor[v] == -1:
                u = v  # not yet linked: its own label (the common case for tree and forward edges)
            elif ancestor[ancestor[v]] == -1:
                u = label[v]  # linked right under a forest root: nothing to compress
            else:
                u = evaluate(v)
            if semi[u] < best:
                best = semi[u]
        semi[w] = best
        bucket[best].append(w)
        p = parent[w]
        ancestor[w] = p
        for v in bucket[p]:
            u = evaluate(v)
            idom[v] = u if semi[u] < semi[v] else p
        bucket[p].clear()
    for w in range(1, n):
        if idom[w] != semi[w]:
            idom[w] = idom[idom[w]]
    return idom


def _intervals(idom: list[int]) -> tuple[list[int], list[int]]:
    """A numbering of the dominator tree (node 0 its root) where every subtree is one
    range: (first number, one past the last) per node. A node's immediate dominator has a
    smaller DFS number, so two passes over the numbers do: subtree sizes bottom-up, then
    ranges top-down, each child taking the next free part of its parent's range."""
    n = len(idom)
    size = [1] * n
    for v in range(n - 1, 0, -1):
        size[idom[v]] += size[v]
    enter = [0] * n
    free = [1] * n  # next number free inside each node's range
    for v in range(1, n):
        d = idom[v]
        enter[v] = free[d]
        free[d] += size[v]
        free[v] = enter[v] + 1
    return enter, [enter[v] + size[v] for v in range(n)]
