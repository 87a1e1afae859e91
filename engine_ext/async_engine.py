"""Runs the synchronous LLMEngine on a background thread and streams results to asyncio.

Only the engine thread touches the engine: requests and aborts reach it through a
queue, so the event loop never waits on a model step (steps can take hundreds of ms
on a CPU) and the engine never needs a lock.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from engine_ext.engine import LLMEngine, RequestOutput
from engine_ext.errors import EngineDeadError, EngineError
from engine_ext.probes import Probes
from engine_ext.served import ReuseCounters
from engine_ext.timeline import Timeline
from engine_ext.request import EngineRequest

logger = logging.getLogger(__name__)
T = TypeVar("T")


def build_off_thread(build: Callable[[], T]) -> T:
    """`build()` run on a thread that ends when it returns (its exception re-raised here).

    Build the engine this way when another thread will step it. Loading a model runs
    parallel torch ops, which leave an OpenMP thread team on the thread that ran them;
    with a second thread's team alive, libgomp slows every parallel region of the engine
    thread (a SmolLM2 fp32 decode step took 48.7 ms against 27.9 ms, measured). A team
    ends with its thread, so the engine thread is then the only one with a team."""
    with ThreadPoolExecutor(1, thread_name_prefix="kvrelay-engine-build") as pool:
        return pool.submit(build).result()  # leaving `with` joins the thread


@dataclass
class _Add:
    request: EngineRequest
    sink: asyncio.Queue[RequestOutput | BaseException]
    loop: asyncio.AbstractEventLoop
    timeline: Timeline  # stamped from when the caller asked, so the wait for the engine thread counts as queue


@dataclass
class _Abort:
    request_id: str


class _Wake:
    """A KV transfer landed: wake the engine thread to apply it (no command)."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine, probes: Probes | None = None) -> None:
        self.engine = engine
        self.model = engine.served()  # what the serving layer reads of the model (engine_ext/served.py)
        self.probes = probes if probes is not None else Probes(chunk_tokens=engine.config.probe_chunk_tokens)
        self._commands: queue.SimpleQueue[_Add | _Abort | _Wake | None] = queue.SimpleQueue()
        # The engine thread sleeps on this queue alone: a landed transfer rings it too. The
        # ring holds the queue, never `self`: the transfer thread lives until the engine is
        # collected, and through `self` it would keep the engine (and its host tier) alive.
        commands = self._commands
        engine.wake_on_transfers(lambda: commands.put(_Wake()))
        self._taken: list[_Add | _Abort | None] = []  # the command `_commands_waiting` took off the queue
        self._woken = False  # a ring `_commands_waiting` dropped: step once more before sleeping
        self._sinks: dict[str, _Add] = {}
        self._thread: threading.Thread | None = None
        self._dead: BaseException | None = None

    def reuse_counters(self) -> ReuseCounters:
        """What the reuse methods did since start (for /metrics), read off the engine thread."""
        return self.engine.reuse_counters()

    def resident_blocks(self) -> tuple[list[bytes], list[bytes]]:
        """The hashes of the blocks on the device and of those only in a lower tier."""
        return self.engine.resident_blocks()

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._dead is None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvrelay-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        if self._thread is not None:
            self._commands.put(None)
            self._thread.join(timeout)
        if self._thread is None or not self._thread.is_alive():  # only the engine thread may touch the engine
            self.engine.close()

    async def generate(self, request: EngineRequest, timeline: Timeline | None = None
                       ) -> AsyncGenerator[RequestOutput, None]:
        """Yield the request's outputs until it finishes. Raises the engine's validation
        errors on first iteration; leaving the iteration early aborts the request.
        `timeline` (arrival: now) is the caller's to read, even if the request fails."""
        if not self.is_alive:
            raise EngineDeadError("the engine is not running")
        sink: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        line = timeline if timeline is not None else Timeline()
        line.enqueue()
        self._commands.put(_Add(request, sink, loop, line))
        finished = False
        try:
            while not finished:
                item = await sink.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self._commands.put(_Abort(request.request_id))

    # -- engine thread -----------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                if not self._drain_commands(self._sleep_s()):
                    break
                if self.probes.has_jobs:  # the scheduler runs a dense re-score only in steps no request wants
                    self.probes.tick(self.engine)
                if self.engine.has_work:
                    self._step()
        except BaseException as exc:  # the thread must report why it died, then stop serving
            logger.exception("engine thread died")
            self._dead = exc
            self._fail_all(EngineDeadError(f"the engine stopped: {exc}"))

    def _sleep_s(self) -> float:
        """How long the loop may wait on its command queue before stepping again; a command,
        or a KV transfer landing (it rings the queue), ends the wait early.
        - Nothing to step (transfers may be in flight): 0.5 s.
        - Only a probe's dense score, waiting for the engine to be idle `probe_idle_ms`:
          until then. Stepping meanwhile would run empty steps at ~1 kHz for the whole
          window, on the cores (and the GIL) the next agent's request needs.
        - A step that could run nothing (a round held for its siblings): 1 ms, not a spin."""
        if self._woken:  # a ring `_commands_waiting` dropped: step once more before sleeping
            self._woken = False
            return 0.0
        if not self.engine.has_sequences and not self.probes.has_jobs:
            return 0.5
        hold = self.engine.background_wait_s
        if hold > 0.0:
            return hold
        return 0.001 if self.engine.last_step_empty else 0.0

    def _drain_commands(self, timeout: float) -> bool:
        """Apply queued commands, waiting up to `timeout` s for the first; False once asked to stop."""
        cmd: _Add | _Abort | _Wake | None
        while True:
            if self._taken:
                cmd = self._taken.pop()
            else:
                try:
                    cmd = self._commands.get(timeout=timeout) if timeout > 0 else self._commands.get_nowait()
                except queue.Empty:
                    return True
            timeout = 0.0
            if isinstance(cmd, _Wake):
                continue
            if cmd is None:
                self._fail_all(EngineDeadError("the engine is shutting down"))
                return False
            if isinstance(cmd, _Abort):
                self._sinks.pop(cmd.request_id, None)
                self.probes.forget(cmd.request_id)
                try:
                    self.engine.abort(cmd.request_id)
                except Exception:
                    # Releasing its blocks failed half way: the pool's bookkeeping is suspect.
                    logger.exception("aborting request %s failed; failing the running requests", cmd.request_id)
                    self._fail_all(EngineError("the engine failed while cancelling a request"))
                continue
            try:
                seq = self.engine.add_request(cmd.request, timeline=cmd.timeline)
            except EngineError as exc:
                _deliver(cmd, exc)
                continue
            except Exception as exc:
                # A bug admitting one request fails that request, never the loop. Admission
                # computes nothing into the KV pool, so nothing shared needs resetting; a
                # half-queued sequence is taken back out.
                logger.exception("adding request %s failed; failing it alone", cmd.request.request_id)
                self.engine.abort(cmd.request.request_id)
                _deliver(cmd, EngineError(f"the engine failed to admit the request ({type(exc).__name__})"))
                continue
            self._sinks[cmd.request.request_id] = cmd
            if cmd.request.probe:
                self.probes.watch(seq)

    def _commands_waiting(self) -> bool:
        """Asked between the layers of a background step: a request (or an abort) is queued.
        A landed transfer's ring is not one (a probe stopped for each backup that lands
        would start over for nothing): it is dropped, and the next loop steps once more to
        apply the transfer. The first real command is kept for `_drain_commands`."""
        while not self._taken:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return False
            if isinstance(cmd, _Wake):
                self._woken = True
            else:
                self._taken.append(cmd)  # None (stop) included
                return True
        return True

    def _step(self) -> None:
        try:
            outputs = self.engine.step(interrupt=self._commands_waiting)
        except Exception as exc:
            # A failed step may have half-written KV blocks: fail its requests and drop
            # every cached hash so no later request reuses possibly corrupt blocks.
            logger.exception("engine step failed; failing its requests")
            self._fail_all(EngineError(f"engine step failed: {exc}"))
            return
        self.probes.after_step()
        for out in outputs:
            target = self._sinks.get(out.request_id)
            if target is None:
                continue
            if out.finished:
                del self._sinks[out.request_id]
                self.probes.finished(out.request_id)
            if not _deliver(target, out) and not out.finished:
                # The caller's loop closed without aborting (its generator never ran its
                # `finally`): stop computing for nobody.
                self._sinks.pop(out.request_id, None)
                self.probes.forget(out.request_id)
                self.engine.abort(out.request_id)

    def _fail_all(self, exc: BaseException) -> None:
        for request_id, target in list(self._sinks.items()):
            self.engine.abort(request_id)
            _deliver(target, exc)
        self._sinks.clear()
        self.probes.reset(self.engine)
        # Lower KV tiers keep their copies: each was made from a published (fully
        # computed) block after a step that succeeded.
        self.engine.kv.pool.reset_cache()


def _deliver(target: _Add, item: RequestOutput | BaseException) -> bool:
    """Hand `item` to the caller's event loop; False when that loop has closed (nobody
    is listening any more)."""
    try:
        target.loop.call_soon_threadsafe(target.sink.put_nowait, item)
    except RuntimeError:
        logger.debug("dropping output for %s: its event loop has closed", target.request.request_id)
        return False
    return True
