"""A kvrelay stack as real processes on loopback, for the reliability benchmark: engines
and a gateway started with the CLI, each killable, restartable and measurable (RSS)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from benchmarks.common import free_port

CLI = [sys.executable, "-c", "import sys; from kvrelay.cli import main; sys.argv = ['kvrelay', *sys.argv[1:]]; main()"]


class Service:
    """One CLI process (engine or gateway) on a loopback port."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], log_dir: Path,
                 wrapper: tuple[str, ...] = ()) -> None:
        self.name = name
        self.wrapper = wrapper  # a command the CLI runs under (`taskset -c 0`)
        self.port = free_port()
        self.args = [*args, "--port", str(self.port)]
        self.env = {**os.environ, **env}
        self.log = log_dir / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120.0) -> Service:
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen([*self.wrapper, *CLI, *self.args], env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        deadline = time.monotonic() + timeout
        while True:
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = self.log.read_text(errors="replace")[-800:]
                raise RuntimeError(f"{self.name} did not start: {tail}")
            time.sleep(0.1)

    def rss_mb(self) -> float:
        """Resident memory of the process, MiB (Linux /proc)."""
        if self.proc is None:
            return 0.0
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return 0.0

    def kill(self) -> None:
        """SIGKILL: a crash, nothing flushed."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        """SIGTERM and wait: a clean shutdown (the gateway flushes its records)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()


def engine(name: str, model: str, log_dir: Path, secret: str, *extra: str) -> Service:
    return Service(name, ["engine", "--model", model, "--served-model-name", "m", "--max-num-seqs", "64", *extra],
                   {"KVRELAY_PLAN_SECRET": secret}, log_dir)


def gateway(upstreams: list[str], db_url: str, log_dir: Path, secret: str, admin_key: str,
            name: str = "gateway") -> Service:
    args = ["gateway", "--database-url", db_url, "--log-level", "warning"]
    for url in upstreams:
        args += ["--upstream", url]
    env = {"KVRELAY_PLAN_SECRET": secret, "KVRELAY_ADMIN_KEY": admin_key, "KVRELAY_HEALTH_INTERVAL_S": "0.5",
           "KVRELAY_INFERENCE__MAX_SESSIONS": "2000"}
    return Service(name, args, env, log_dir)


def kv_bytes_per_token(model: str) -> int:
    """KV bytes one token takes in the engine (float32), from the model's config."""
    import json

    config = json.loads((Path(model) / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    return config["num_hidden_layers"] * 2 * kv_heads * head_dim * 4
