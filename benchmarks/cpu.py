"""CPU placement and CPU time of a benchmark's server processes (Linux /proc).

Why: on a small machine, a latency difference between two paths says as much about who
got the core as about the code on it. Pinning the process under test to a core of its
own, and counting the CPU time it spent, gives a figure that does not move with the
scheduler: CPU seconds per request.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    """Which CPUs the process under test gets, and which everything else (load, upstream) gets.
    Empty sets: no pinning (a single CPU, or no sched_setaffinity on this platform)."""

    tested: frozenset[int]
    others: frozenset[int]

    def describe(self) -> tuple[str, str]:
        """(the tested process's CPUs, everything else's), for a table row."""
        if not self.tested:
            return "not pinned (< 2 CPUs)", "not pinned"
        return f"CPU {_cpus(self.tested)}", f"load gen, upstream, driver: CPU {_cpus(self.others)}"


def split_cpus(tested_share: float = 0.0) -> Placement:
    """The last available CPUs for the processes under test, the rest for everything else:
    one CPU, or `tested_share` of them (at least one, and one left for the others)."""
    if not hasattr(os, "sched_getaffinity"):
        return Placement(frozenset(), frozenset())
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return Placement(frozenset(), frozenset())
    num_tested = min(len(cpus) - 1, max(1, int(len(cpus) * tested_share)))
    return Placement(frozenset(cpus[-num_tested:]), frozenset(cpus[:-num_tested]))


def pin_self(cpus: frozenset[int]) -> None:
    """Restrict the calling process (and what it starts later) to `cpus`; no-op for an empty set.
    Meant as a Popen preexec_fn, so the server is pinned before its first thread exists."""
    if cpus:
        os.sched_setaffinity(0, cpus)


@contextmanager
def pinned(cpus: frozenset[int]) -> Iterator[None]:
    """The calling process restricted to `cpus` for the block, its affinity restored after
    (a bench run from pytest must not leave the test process pinned)."""
    if not cpus:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


_TICK_S = 1 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process, all its threads (dead ones too), in seconds;
    None where /proc is not available. Resolution: one clock tick (usually 10 ms)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces; fields after its closing ')' are fixed.
    fields = stat[stat.rindex(b")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) * _TICK_S  # utime, stime: fields 14 and 15


def tree_cpu_seconds(pid: int) -> float | None:
    """cpu_seconds of a process and every live process below it (a server's workers);
    None where /proc is not available or `pid` is gone."""
    own = cpu_seconds(pid)
    if own is None:
        return None
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue  # ended meanwhile
            parent = int(stat[stat.rindex(b")") + 2:].split()[1])  # field 4: ppid
            children.setdefault(parent, []).append(int(entry))
    total, todo = own, list(children.get(pid, []))
    while todo:
        child = todo.pop()
        total += cpu_seconds(child) or 0.0
        todo += children.get(child, [])
    return total


def settled_cpu_seconds(pid: int, quiet_s: float = 0.1, limit_s: float = 5.0) -> float | None:
    """The CPU time of the process and its workers once they have stopped spending any for
    `quiet_s`: work a load leaves behind (records written in the background) is counted
    with that load."""
    deadline = time.monotonic() + limit_s
    last = tree_cpu_seconds(pid)
    while last is not None and time.monotonic() < deadline:
        time.sleep(quiet_s)
        now = tree_cpu_seconds(pid)
        if now == last:
            break
        last = now
    return last


def _cpus(cpus: frozenset[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus))
