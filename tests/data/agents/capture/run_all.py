"""Capture every agent app: start the embedded engine and the recorder on loopback, run
each app (in the agents venv, where the frameworks live) against the recorder, let the
recorder save each app's capture to tests/data/agents/<app>.jsonl (the long family's to
tests/data/agents/long/<app>.jsonl), then label them.

    make agents-venv agents-capture
    .venv/bin/python tests/data/agents/capture/run_all.py --agents-python .venv-agents/bin/python [--apps village_sep]
    .venv/bin/python tests/data/agents/capture/run_all.py --family long   # the long-context family

Standard library only (the recorder and the labeller are too); the engine runs as the
`kvrelay engine` command next to this interpreter, unless --engine-url names one that
already runs.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
DATA = HERE.parent
sys.path.insert(0, str(HERE))

import label  # noqa: E402 (a sibling script, not a package)
import recorder  # noqa: E402

# Cheap apps first: a broken framework setup shows within seconds.
FAMILIES: dict[str, list[str]] = {
    "short": ["autogen_roundrobin", "autogen_selector", "autogen_tool", "langgraph_pipeline", "langgraph_react",
              "openai_agents", "kvcomm_team", "village_sep", "village_plain"],
    # Long passages and 128-token answers, where KV reuse has something to win. A
    # directory of their own, so the short family's files (and their loaders) stay apart.
    "long": ["board_openai", "board_autogen", "village_long"],
}
FAMILY_DIRS = {"short": ".", "long": "long"}  # under --out-dir
APPS = [app for apps in FAMILIES.values() for app in apps]
ENGINE_START_S = 300.0  # the first start converts the model (about 20 s); a busy machine is slower
APP_TIMEOUT_S = 3600.0  # a long-family app takes several minutes, more on a busy machine


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_healthy(url: str, process: subprocess.Popen[bytes] | None, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the engine exited with {process.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(1.0)  # not up yet
    raise RuntimeError(f"the engine at {url} was not healthy within {timeout_s:.0f} s")


def start_engine(kvrelay: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    process = subprocess.Popen([str(kvrelay), "engine", "--host", "127.0.0.1", "--port", str(port),
                                "--log-level", "warning"])  # no access log: the recorder keeps the traffic
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, process, ENGINE_START_S)
    except RuntimeError:
        process.terminate()
        raise
    return process, url


def capture_path(out_dir: Path, app: str) -> Path:
    """Where an app's capture goes: its family's directory under `out_dir`."""
    family = next(family for family, apps in FAMILIES.items() if app in apps)
    return out_dir / FAMILY_DIRS[family] / f"{app}.jsonl"


def run_app(agents_python: Path, app: str, recorder_url: str, out: Path) -> float:
    started = time.monotonic()
    subprocess.run([str(agents_python), str(HERE / "apps" / f"{app}.py"), "--recorder", recorder_url,
                    "--out", str(out)], check=True, timeout=APP_TIMEOUT_S)
    return time.monotonic() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents-python", type=Path, default=Path(".venv-agents/bin/python"))
    parser.add_argument("--kvrelay", type=Path, default=Path(sys.executable).parent / "kvrelay",
                        help="the kvrelay command that serves the engine")
    parser.add_argument("--engine-url", help="an engine that already runs (else one is started)")
    parser.add_argument("--family", choices=list(FAMILIES), default="short",
                        help="capture this family's apps (when --apps is not given)")
    parser.add_argument("--apps", nargs="+", choices=APPS, help="these apps, of any family")
    parser.add_argument("--out-dir", type=Path, default=DATA)
    args = parser.parse_args()
    apps: list[str] = args.apps or FAMILIES[args.family]

    engine: subprocess.Popen[bytes] | None = None
    if args.engine_url:
        engine_url = args.engine_url.rstrip("/")
        wait_healthy(engine_url, None, 10.0)
    else:
        engine, engine_url = start_engine(args.kvrelay)
    server = recorder.make_server(engine_url)
    thread = threading.Thread(target=server.serve_forever, name="recorder", daemon=True)
    thread.start()
    timings: dict[str, float] = {}
    try:
        for app in apps:
            timings[app] = run_app(args.agents_python, app, server.url, capture_path(args.out_dir, app))
            print(f"{app}: {timings[app]:.1f} s", flush=True)
    finally:
        server.shutdown()
        server.server_close()
        if engine is not None:
            engine.terminate()
            engine.wait(timeout=60)
    for app in apps:
        path = capture_path(args.out_dir, app)
        header, records = label.read_capture(path)
        quotes, notes = label.label_capture(header, records)
        for record, q in zip(records, quotes, strict=True):
            record["quotes"] = q
        label.write_capture(path, header, records)
        print(f"{app}: {len(records)} requests, {json.dumps(notes.summary())}")
    per_app = json.dumps({app: round(seconds, 1) for app, seconds in timings.items()})
    print(f"capture took {sum(timings.values()):.1f} s in all: {per_app}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
