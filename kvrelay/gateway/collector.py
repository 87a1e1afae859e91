"""Python's cyclic garbage collector, set for a process that serves the gateway.

Measured under `kvrelay bench gateway` with perf: 78% of the gateway's CPU was the
interpreter running Python, and 8% the collector's own walks. Two reasons, both from
CPython's defaults, which suit short scripts:
- A young collection runs every 700 net allocations of container objects: several
  times per proxied request. Each one promotes whatever request-scoped objects happen to
  be alive at that instant (the other streams in flight) to the older generations, which
  the collector then walks again and again before they die.
- A full collection walks every tracked object of the process, and most of those are
  the imports (FastAPI, pydantic, SQLAlchemy, aiohttp, OpenTelemetry, numpy): hundreds of
  thousands of objects that live as long as the process. That walk was the tail.
So, once the app is built and before it serves: one collection, then `gc.freeze()`
moves every object alive (the imports, the app) out of the collector's sight for good,
and the young threshold goes up to YOUNG_THRESHOLD, so most request-scoped objects are
freed by reference counting before a collection ever sees them. Cycles are still
collected, a little later. What the app restores and infers afterwards is not frozen.

Only for processes that serve the gateway and nothing else of the caller's (the CLI's
`gateway` and `up`, gateway workers), never in `create_app`: freezing a test process
would keep the cycles of every app it had built so far alive.
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 20_000  # net allocations between young collections (CPython's default: 700)


def tune_for_serving() -> None:
    """Freeze what is alive now and raise the young threshold; call once, before serving."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, old)
