"""Capture every agent app: start the embedded engine and the recorder on loopback, run
each app (in the agents venv, where the frameworks live) against the recorder, let the
recorder save each app's capture to tests/data/agents/<app>.jsonl, then label them.

    make agents-venv agents-capture
    .venv/bin/python tests/data/agents/capture/run_all.py --agents-python .venv-agents/bin/python [--apps village_sep]

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
APPS = ["autogen_roundrobin", "autogen_selector", "autogen_tool", "langgraph_pipeline", "langgraph_react",
        "openai_agents", "kvcomm_team", "village_sep", "village_plain"]
ENGINE_START_S = 300.0  # the first start converts the model (about 20 s); a busy machine is slower
APP_TIMEOUT_S = 1200.0


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
    parser.add_argument("--apps", nargs="+", choices=APPS, default=APPS)
    parser.add_argument("--out-dir", type=Path, default=DATA)
    args = parser.parse_args()

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
        for app in args.apps:
            timings[app] = run_app(args.agents_python, app, server.url, args.out_dir / f"{app}.jsonl")
            print(f"{app}: {timings[app]:.1f} s", flush=True)
    finally:
        server.shutdown()
        server.server_close()
        if engine is not None:
            engine.terminate()
            engine.wait(timeout=60)
    for app in args.apps:
        path = args.out_dir / f"{app}.jsonl"
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
