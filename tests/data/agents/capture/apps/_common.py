"""What every capture app shares: the recorder's control calls, tag base URLs, and the
model settings the brief fixes (greedy; short answers, longer ones in the long family).

Standard library only: the apps run in .venv-agents, which holds the frameworks and
nothing of kvrelay. An app is run as

    .venv-agents/bin/python tests/data/agents/capture/apps/<app>.py --recorder URL --out FILE

and registers its runs and scripts, drives its framework through tag base URLs, then
asks the recorder to save the capture to FILE.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 48  # the brief's budget for a normal answer: short prompts stay well inside the context
# The long family's answers (tests/data/agents/long): long enough that a later agent's
# prompt, which quotes them, is mostly text an earlier request already computed.
LONG_MAX_TOKENS = 128
TEMPERATURE = 0.0
API_KEY = "unused"  # OpenAI clients insist on one; the recorder never records it


@dataclass(frozen=True)
class Run:
    """One run of an app: its id, task and the concurrent group it ran in (if any)."""
    run: str
    task: str
    concurrent_group: str | None = None


class RecorderClient:
    """Control calls to the recorder for one app."""

    def __init__(self, url: str, app: str) -> None:
        self.url = url.rstrip("/")
        self.app = app

    def _post(self, path: str, data: dict[str, Any]) -> dict[str, Any]:
        request = urllib.request.Request(self.url + path, data=json.dumps(data).encode(),
                                         headers={"content-type": "application/json"}, method="POST")
        with urllib.request.urlopen(request, timeout=60) as response:
            return json.loads(response.read())

    def base_url(self, run: str, agent: str, round_: int | str | None = None) -> str:
        """The base_url a client of this agent uses: the tag path the recorder reads."""
        parts = [self.app, run, agent, "-" if round_ is None else str(round_)]
        return f"{self.url}/tag/" + "/".join(urllib.parse.quote(p, safe="") for p in parts) + "/v1"

    def register_run(self, run: Run) -> None:
        self._post("/_run", {"app": self.app, "run": run.run, "task": run.task,
                             "concurrent_group": run.concurrent_group})

    def script(self, run: str, agent: str, steps: list[dict[str, Any] | None]) -> None:
        """Answer this agent's k-th request of the run with steps[k]'s tool calls (None:
        the model answers)."""
        self._post("/_script", {"app": self.app, "run": run, "agent": agent, "steps": steps})

    def save(self, framework_package: str, description: str, path: str) -> dict[str, Any]:
        version = importlib.metadata.version(framework_package)
        return self._post("/_save", {"workload": self.app, "framework": f"{framework_package}=={version}",
                                     "description": description, "model": MODEL, "path": path})


def tool_call(name: str, **arguments: Any) -> dict[str, Any]:
    """One script step: a single tool call."""
    return {"tool_calls": [{"name": name, "arguments": arguments}]}


def parse_args(app: str) -> tuple[RecorderClient, str]:
    parser = argparse.ArgumentParser(description=f"capture app {app}")
    parser.add_argument("--recorder", required=True, help="the recorder's URL, e.g. http://127.0.0.1:9100")
    parser.add_argument("--out", required=True, help="where the recorder writes the capture (JSONL)")
    args = parser.parse_args()
    return RecorderClient(args.recorder, app), args.out
