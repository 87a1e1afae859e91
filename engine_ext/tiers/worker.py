"""TransferWorker: the background thread that moves KV blocks between tiers.

Copies run one at a time: loads first (a request may be waiting for one), then backups
and demotions in submission order, so a tier slot that is emptied by one copy (a
demotion to disk) and refilled by the next (a backup) never mixes the two. A load
never touches a slot a backup or demotion writes: it reads a ready, pinned slot into
pinned device blocks.
Completion is reported, not acted on: the engine thread collects finished transfers
with `completed` and updates the pool and the tiers itself, so nothing but tensor
rows is ever shared between the threads. A driver that sleeps on its own queue sets
`notify`, called on this thread after each transfer lands, to be woken for it.
The copies (numpy, engine_ext/tiers/copies.py) release the GIL, so model steps on the
engine thread run while a transfer is in flight; they still take one of the cores.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

logger = logging.getLogger(__name__)

TransferKind = Literal["backup", "demote", "load"]


@dataclass
class Transfer:
    kind: TransferKind
    copy: Callable[[], None]  # runs on the worker thread
    on_done: Callable[[Transfer], None]  # runs on the engine thread, once `copy` returned or raised
    num_blocks: int
    error: BaseException | None = field(default=None, init=False)


class TransferWorker:
    def __init__(self) -> None:
        self._todo: queue.PriorityQueue[tuple[int, int, Transfer | None]] = queue.PriorityQueue()
        self._order = itertools.count()  # FIFO among transfers of one priority
        self._done: queue.SimpleQueue[Transfer] = queue.SimpleQueue()
        self.num_in_flight = 0
        self.notify: Callable[[], None] | None = None  # called on the worker thread as each transfer lands
        self._thread = threading.Thread(target=self._run, name="kvrelay-kv-transfer", daemon=True)
        self._thread.start()

    def submit(self, transfer: Transfer) -> None:
        self.num_in_flight += 1
        self._todo.put((0 if transfer.kind == "load" else 1, next(self._order), transfer))

    def completed(self, timeout: float = 0.0) -> list[Transfer]:
        """Transfers finished since the last call; waits up to `timeout` s for the first
        when none has (the engine has nothing to run until a load arrives)."""
        out: list[Transfer] = []
        wait = timeout if timeout > 0 and self.num_in_flight else 0.0
        while True:
            try:
                item = self._done.get(timeout=wait) if wait else self._done.get_nowait()
            except queue.Empty:
                break
            wait = 0.0
            out.append(item)
        self.num_in_flight -= len(out)
        return out

    def stop(self) -> None:
        """Let the thread end after every transfer already submitted; returns at once."""
        self._todo.put((2, next(self._order), None))

    def close(self) -> None:
        self.stop()
        self._thread.join(timeout=10.0)

    def _run(self) -> None:
        while (transfer := self._todo.get()[2]) is not None:
            try:
                transfer.copy()
            except Exception as exc:  # reported to the engine thread, which undoes the transfer
                logger.exception("KV %s of %d blocks failed", transfer.kind, transfer.num_blocks)
                transfer.error = exc
            self._done.put(transfer)
            if self.notify is not None:
                self.notify()
