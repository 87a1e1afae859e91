"""Shared helpers for the test suite (importable as `tests.helpers`)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import uvicorn
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider

from engine_ext.async_engine import AsyncEngine
from engine_ext.config import EngineConfig
from engine_ext.engine import LLMEngine
from kvrelay.wire.seal import PlanSeal
from engine_ext.server import create_app

# KV bytes of one 16-token block of the tiny models (2 layers, 2 kv heads, head_dim 16, fp32).
TINY_BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4

CORPUS = """
The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat.
Paris is the capital of France and Berlin is the capital of Germany. Rome is in Italy.
A small model reads tokens one by one and writes the next token after thinking about it.
Agents talk to each other, share a prompt, and reuse the cache of keys and values.
The engine schedules requests in batches; every step decodes one token for each request.
Numbers like 1 2 3 4 5 6 7 8 9 10 and 42 or 2024 appear in many documents and tables.
Water boils at one hundred degrees and freezes at zero degrees on the Celsius scale.
She sells sea shells by the sea shore, and the shells she sells are surely sea shells.
Good morning! How are you today? I am fine, thank you. What is your name? My name is Bob.
Write a short poem about the moon, the stars, the night sky and the silent ocean waves.
The system prompt says: you are a helpful assistant that answers questions briefly.
Please summarise the following document in three sentences and list the key points.
Memory is measured in blocks; each block holds sixteen tokens of keys and values.
When the pool runs dry the newest request is preempted and later recomputed again.
Alice met Bob at the station, then they walked to the museum and looked at paintings.
Computers compute; teachers teach; writers write; readers read; singers sing songs.
""" * 3


def kv_bytes(num_blocks: int, block_size: int = 16, dtype: str = "float32") -> int:
    """kv_cache_bytes giving exactly `num_blocks` blocks for the tiny models."""
    itemsize = 4 if dtype == "float32" else 2
    return num_blocks * TINY_BLOCK_BYTES * block_size // 16 * itemsize // 4


def make_engine(model_dir: Path, num_blocks: int = 64, name: str | None = None, **kw) -> LLMEngine:
    block_size = kw.pop("block_size", 16)
    dtype = kw.get("dtype", "float32")
    cfg = EngineConfig(kv_cache_bytes=kv_bytes(num_blocks, block_size, dtype), block_size=block_size, **kw)
    engine = LLMEngine(model_dir, cfg, model_name=name)
    assert engine.kv_cache.num_blocks == num_blocks
    return engine


@dataclass
class RunningServer:
    base_url: str  # http://127.0.0.1:PORT
    llm: LLMEngine
    async_engine: AsyncEngine
    model_name: str

    @property
    def v1(self) -> str:
        return self.base_url + "/v1"

    def wait_idle(self, timeout: float = 5.0) -> bool:
        """Poll until the engine has no work and every KV block is free again."""
        deadline = time.monotonic() + timeout
        pool = self.llm.kv.pool
        while time.monotonic() < deadline:
            if not self.llm.has_work and pool.num_free == pool.num_blocks:
                return True
            time.sleep(0.02)
        return False


@contextmanager
def serve(llm: LLMEngine, model_name: str, tracer_provider: TracerProvider | None = None,
          plan_seal: PlanSeal | None = None) -> Iterator[RunningServer]:
    """Run the OpenAI server for `llm` in a background thread on a free loopback port."""
    async_engine = AsyncEngine(llm)
    app = create_app(async_engine, model_name, tracer_provider, plan_seal)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)

    def run() -> None:
        asyncio.run(server.serve(sockets=[sock]))

    thread = threading.Thread(target=run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield RunningServer(f"http://127.0.0.1:{port}", llm, async_engine, model_name)
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()


def answers(url: str) -> bool:
    """`url` answers 200 now (a server still starting refuses, or is slow to answer)."""
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def wait_until(pred: Callable[[], bool], timeout: float = 5.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return pred()


def undocumented_names(spans: Iterable[ReadableSpan]) -> set[str]:
    """The kvrelay.* span, event and attribute names in `spans` that kvrelay/wire/trace_names.py
    does not list (a per-kind or per-stage part, like num_<kind>, matches its pattern)."""
    import re

    from kvrelay.wire import trace_names

    doc = trace_names.__doc__ or ""
    patterns = [re.escape(name).replace(re.escape("<kind>"), "[a-z_]+").replace(re.escape("<stage>"), "[a-z]+")
                for name in re.findall(r"kvrelay\.[a-z0-9_.<>]+[a-z0-9_>]", doc)]
    found = set()
    for span in spans:
        found.add(span.name.split(" ")[0])
        found.update(event.name.split(" ")[0] for event in span.events)
        found.update(key for event in span.events for key in event.attributes)
        found.update(span.attributes or {})
    return {name for name in found if name.startswith("kvrelay.")
            and not any(re.fullmatch(p, name) for p in patterns)}


LINEAR_RATIO_BOUND = 8.0  # for 4x the input: linear 4, quadratic 16; room for a noisy machine


def cpu_ratio(run_small: Callable[[], object], run_large: Callable[[], object]) -> float:
    """CPU time of `run_large` over `run_small`, each the best of three runs: a complexity
    ratio, steady on a noisy machine where a wall-time bound is not."""
    def best(run: Callable[[], object]) -> float:
        times = []
        for _ in range(3):
            start = time.process_time()
            run()
            times.append(time.process_time() - start)
        return max(min(times), 1e-4)

    return best(run_large) / best(run_small)


def slow_with_abort_spy(llm: LLMEngine, monkeypatch, step_s: float = 0.01) -> list[str]:
    """Slow each engine step down (so a long request outlives its client) and return the
    list the ids of aborted requests are appended to."""
    aborted: list[str] = []
    step, abort = llm.step, llm.abort

    def slow_step(interrupt=None):
        time.sleep(step_s)
        return step(interrupt)

    def spy_abort(request_id):
        ok = abort(request_id)
        aborted.append(request_id)
        return ok

    monkeypatch.setattr(llm, "step", slow_step)
    monkeypatch.setattr(llm, "abort", spy_abort)
    return aborted
