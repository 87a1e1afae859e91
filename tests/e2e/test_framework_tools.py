"""Agent frameworks really call their tools through `make run`: `kvrelay up` with every
default (SmolLM2-135M-Instruct on the embedded engine) as a real process, and the apps
in tests/e2e/apps run by the frameworks' own venv (.venv-agents, `make agents-venv`):
an AutoGen tool agent, a LangGraph ReAct agent (unary and streaming) and an OpenAI
Agents SDK agent (unary and streaming). Each must invoke a tool with arguments its schema
accepts, finish with a non-empty answer the model wrote, and leave its requests in the
gateway's records (the tool result seen in a later prompt, every request answered).

Skipped without the agents venv, unless KVRELAY_REQUIRE_AGENTS=1 (CI, .ci/run): then
a missing venv fails."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from sqlalchemy import create_engine, select
from sqlalchemy.orm import Session

from kvrelay.gateway.storage.models import RequestRow, SegmentRow
from tests.gateway.support import free_port, read_rows, wait_until


ROOT = Path(__file__).resolve().parents[2]
APPS = Path(__file__).resolve().parent / "apps"
AGENTS_VENV = ROOT / ".venv-agents"
AGENTS_PYTHON = AGENTS_VENV / "bin" / "python"
AGENTS_STAMP = AGENTS_VENV / ".kvrelay-installed"  # the Makefile's: the pinned install finished
KVRELAY = Path(sys.executable).parent / "kvrelay"  # the console script `make run` starts
# Read at import, like KVRELAY_REQUIRE_BROWSER: the gateway fixtures clear KVRELAY_*.
REQUIRED = os.environ.get("KVRELAY_REQUIRE_AGENTS") == "1"
START_TIMEOUT_S = 180.0  # a first start converts the model (about 20 s); a busy machine is slower
APP_TIMEOUT_S = 180.0
RECORD_TIMEOUT_S = 15.0  # the record writer and the inference store flush every 0.5 s
# The tools every app offers, as the frameworks describe them: what the model's calls must fit.
TOOL_SCHEMAS: dict[str, dict[str, Any]] = {
    "get_weather": {"type": "object", "properties": {"city": {"type": "string", "minLength": 1}},
                    "required": ["city"], "additionalProperties": False},
    "multiply": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                 "required": ["a", "b"], "additionalProperties": False},
}


@dataclass(frozen=True)
class Stack:
    url: str
    db_path: Path
    log: Path


# Where the converted default model lives: the same one `make run` would load, not a fresh conversion.
KEEP = ("KVRELAY_CACHE_DIR",)


def _environment(drop: tuple[str, ...]) -> dict[str, str]:
    """This process's environment without the variables that would change what runs."""
    return {k: v for k, v in os.environ.items() if k in KEEP or not k.startswith(drop)}


@pytest.fixture(scope="module")
def agents_python() -> Path:
    if not AGENTS_PYTHON.exists() or not AGENTS_STAMP.exists():
        (pytest.fail if REQUIRED else pytest.skip)(f"no agents venv at {AGENTS_VENV} (make agents-venv)")
    return AGENTS_PYTHON


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False  # not listening yet


@pytest.fixture(scope="module")
def stack(agents_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """`kvrelay up` exactly as `make run` starts it (free ports, a SQLite file of its own),
    with no KVRELAY_*/OTEL_* variable of the test run reaching it but the model cache's."""
    folder = tmp_path_factory.mktemp("kvrelay-up")
    port, engine_port = free_port(), free_port()
    db_path, log = folder / "x.sqlite", folder / "kvrelay-up.log"
    command = [str(KVRELAY), "up", "--host", "127.0.0.1", "--port", str(port), "--engine-port", str(engine_port),
               "--database-url", f"sqlite+aiosqlite:///{db_path}"]
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                   env=_environment(("KVRELAY_", "OTEL_")))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _ready(url):
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"kvrelay up was not ready (exit {process.poll()}): "
                            f"{log.read_text(errors='replace')[-2000:]}")
            time.sleep(0.2)
        yield Stack(url, db_path, log)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)  # its own session: only what this test started
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(10)


def run_app(python: Path, app: str, stack: Stack) -> dict[str, Any]:
    """Run one app to its end in the agents venv; its one JSON line of results."""
    env = _environment(("KVRELAY_", "OPENAI_", "LANGCHAIN_", "LANGSMITH_"))  # the app's own settings only
    started = time.monotonic()
    try:
        done = subprocess.run([str(python), str(APPS / f"{app}.py"), "--base-url", f"{stack.url}/v1"],
                              check=False, capture_output=True, text=True, timeout=APP_TIMEOUT_S, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{app} did not finish within {APP_TIMEOUT_S:.0f} s: {exc.stderr!r}")
    assert done.returncode == 0, f"{app} failed ({done.returncode}):\n{done.stderr[-4000:]}"
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"{app} ({time.monotonic() - started:.1f} s): {json.dumps(result)}")
    return result


def check_call(name: str, arguments: Any) -> None:
    """A tool call the model wrote (or a framework ran) names a tool and fits its schema."""
    assert name in TOOL_SCHEMAS, f"unknown tool {name!r}"
    if isinstance(arguments, str):  # the OpenAI wire form: a JSON object as text
        arguments = json.loads(arguments)
    jsonschema.validate(arguments, TOOL_SCHEMAS[name])


def check_run(run: dict[str, Any]) -> None:
    """Tools were called with valid arguments and ran, none failed, and the run ended in an
    answer (not a raw JSON answer of the tool format, not an empty string)."""
    assert "error" not in run, f"the run did not finish ({run['error']}); the tools it ran: {run['invocations']}"
    assert run["invocations"], f"no tool ran: {run}"
    assert run["requested"], f"the model requested no tool: {run}"
    for call in [*run["requested"], *run["invocations"]]:
        check_call(call["name"], call["arguments"])
    assert not run.get("tool_errors"), run["tool_errors"]
    answer = run["final_answer"]
    assert isinstance(answer, str) and answer.strip(), f"no final answer: {run}"
    assert not answer.lstrip().startswith(('{"response"', '{"tool_call')), f"the tool format leaked: {answer!r}"


def tool_sessions(db_path: Path, results: set[str]) -> dict[str, list[RequestRow]]:
    """Session -> its recorded requests, for every session in which the gateway saw one of
    `results` come back as a tool result, once the request carrying it is recorded."""
    engine = create_engine(f"sqlite:///{db_path}")
    try:
        with Session(engine) as session:
            segments = list(session.scalars(select(SegmentRow).where(SegmentRow.kind == "tool")))
    finally:
        engine.dispose()
    rows = read_rows(db_path)
    carriers = {s.session_id for s in segments if s.text in results and any(r.id == s.request_id for r in rows)}
    return {sid: [r for r in rows if r.session_id == sid] for sid in carriers}


def check_records(stack: Stack, result: dict[str, Any], streamed: bool) -> None:
    """The gateway recorded the app's tool traffic: a request whose prompt carried a tool
    result, after the request that called the tool, every one of them answered in full."""
    results = {call["result"] for call in result["invocations"]}
    sessions = wait_until(lambda: tool_sessions(stack.db_path, results), timeout=RECORD_TIMEOUT_S, interval=0.25)
    assert sessions, f"no recorded request carried any of {sorted(results)}"
    for sid, rows in sessions.items():
        assert len(rows) >= 2, f"session {sid}: the call and the answer after it should both be recorded: {rows}"
        for row in rows:
            assert row.endpoint == "/v1/chat/completions"
            assert (row.status, row.http_status) == ("ok", 200), (row.status, row.http_status, row.error_type)
            assert row.completion_sha256 is not None and row.completion_tokens, (row.id, row.completion_tokens)
    if streamed:
        assert any(row.stream for rows in sessions.values() for row in rows), "no streamed request was recorded"


def test_autogen_assistant_calls_its_tools_and_answers(agents_python: Path, stack: Stack) -> None:
    result = run_app(agents_python, "autogen_tools", stack)
    check_run(result)
    assert all(a.strip() for a in result["answers"]), result["answers"]  # every task ended in an answer
    types = result["message_types"]
    assert "ToolCallRequestEvent" in types and "ToolCallExecutionEvent" in types, types
    assert types[-1] == "TextMessage", types  # reflect_on_tool_use: the model's text comes last
    check_records(stack, result, streamed=False)


def test_langgraph_react_agent_calls_its_tools_and_answers(agents_python: Path, stack: Stack) -> None:
    result = run_app(agents_python, "langgraph_react", stack)
    assert [run["streaming"] for run in result["runs"]] == [False, True]
    for run in result["runs"]:
        check_run(run)
        # The model ended the graph: LangGraph's step-limit answer ("Sorry, need more steps")
        # is an AIMessage too, but no model response (no finish_reason).
        assert run["final_type"] == "AIMessage" and run["final_finish_reason"] in ("stop", "length"), (
            f"the model never answered: LangGraph ended the graph with {run['final_answer']!r} after "
            f"{len(run['invocations'])} tool calls: {run['requested']}")
        assert run["message_types"][:3] == ["HumanMessage", "AIMessage", "ToolMessage"], run
    check_records(stack, result, streamed=True)


def test_openai_agents_sdk_agent_calls_its_tools_and_answers(agents_python: Path, stack: Stack) -> None:
    result = run_app(agents_python, "openai_agents_tools", stack)
    assert [run["streaming"] for run in result["runs"]] == [False, True]
    for run in result["runs"]:
        check_run(run)
        assert run["item_types"][:2] == ["ToolCallItem", "ToolCallOutputItem"], run
        assert run["item_types"][-1] == "MessageOutputItem", run
    check_records(stack, result, streamed=True)
