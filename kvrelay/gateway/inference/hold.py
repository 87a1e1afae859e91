"""RoundHold: optionally hold the early requests of an All-Gather round for the rest.

When every request of a round reaches the engine together, the shared outputs they all
read are prefilled once and reused by the others in the same batch (TokenDance's
collective reuse). Holding costs the early requests time to first token, so it is off
by default and bounded to a few milliseconds: a request waits until the round's last
expected request arrives or `hold_ms` passes, whichever is first.
"""

from __future__ import annotations

import asyncio

from kvrelay.wire.plan import RoundInfo


class RoundHold:
    def __init__(self, hold_ms: float) -> None:
        self._hold_s = hold_ms / 1e3
        self._waiting: dict[str, asyncio.Event] = {}  # round id -> set when its last request arrives
        self.num_released_together = 0  # requests released by their round's completion, not the timer

    async def wait(self, round_info: RoundInfo) -> None:
        if round_info.index >= round_info.size - 1:
            event = self._waiting.pop(round_info.id, None)
            if event is not None:
                event.set()
            return
        event = self._waiting.setdefault(round_info.id, asyncio.Event())
        try:
            async with asyncio.timeout(self._hold_s):
                await event.wait()
            self.num_released_together += 1
        except TimeoutError:
            if self._waiting.get(round_info.id) is event:
                del self._waiting[round_info.id]
