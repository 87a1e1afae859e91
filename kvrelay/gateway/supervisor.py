"""Background loops that no exception can stop for good.

The gateway's loops (the record writer, upstream health checks, API key refresh, the
inferred state's saver) each catch the errors they expect. An error nobody expected
(a bug, a third-party exception type) used to end its task silently: records stopped,
health went stale, and /ready still said ready. A `SupervisedTask` logs the failure,
counts it, and starts the loop again after a pause; `alive` is False in between, and
/ready says so.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

logger = logging.getLogger(__name__)


class SupervisedTask:
    def __init__(self, name: str, loop: Callable[[], Coroutine[Any, Any, None]], restart_delay_s: float = 1.0) -> None:
        """`loop()` runs until the task is stopped; it returns only once asked to stop
        (any other end is a failure and is restarted)."""
        self.name = name
        self._loop = loop
        self._restart_delay_s = restart_delay_s
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self.num_restarts = 0

    @property
    def alive(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        self._stopping = False
        self._task = asyncio.create_task(self._loop(), name=self.name)
        self._task.add_done_callback(self._ended)

    async def join(self) -> None:
        """Wait for a loop that was asked to stop (its own way) to return."""
        self._stopping = True
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)

    async def stop(self) -> None:
        """Cancel the loop and wait for it."""
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def _ended(self, task: asyncio.Task[None]) -> None:
        if self._stopping:
            return
        exc = None if task.cancelled() else task.exception()
        logger.error("background task %s ended (%s); restarting it in %.1fs", self.name,
                     "cancelled" if task.cancelled() else repr(exc) if exc else "returned",
                     self._restart_delay_s, exc_info=exc)
        self.num_restarts += 1
        asyncio.get_running_loop().call_later(self._restart_delay_s, self._restart)

    def _restart(self) -> None:
        if not self._stopping and not self.alive:
            self.start()
