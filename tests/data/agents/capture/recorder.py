"""A recording OpenAI upstream for capturing real agent frameworks' traffic.

Agent frameworks are run unchanged, pointed at this server instead of a model. Each
client's base_url carries a tag path that says which app, run, agent and round it is:

    http://127.0.0.1:PORT/tag/<app>/<run>/<agent>/<round>/v1        (round "-": none)

so the capture knows the ground truth without touching the framework. The recorder
strips the tag, forwards the body to the real model (the embedded engine) non-streamed,
and answers in the shape the client asked for: a chat.completion, or an SSE stream it
synthesises from the whole answer when the client sent `stream: true` (a stream's
timing is not what is captured; its bodies are).

A 135M model cannot call tools, so an app scripts them: `POST /_script` says "the k-th
request of this agent in this run is answered with these tool calls" (ids deterministic),
and those answers are recorded with `"scripted": true`. `POST /_run` registers a run's
task text (the labeller looks for it), `POST /_save` writes the capture and resets.

Every body is recorded exactly as the client sent it. The engine refuses (400) some
OpenAI fields it does not implement; the forward then drops the field the engine names
in its error's `param` and retries, and the record lists what was dropped.

Standard library only, so it runs in any venv.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import re
import sys
import threading
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

TAG_PREFIX = "/tag/"
NO_ROUND = "-"
# Headers that describe the connection or the caller's secret, not the client: a replay
# sets its own.
UNRECORDED_HEADERS = frozenset({
    "authorization", "host", "content-length", "connection", "keep-alive", "transfer-encoding",
    "te", "trailer", "upgrade", "proxy-authorization", "proxy-connection", "api-key",
})
# Fields a forward can never drop: without them there is no request.
ESSENTIAL_FIELDS = frozenset({"model", "messages"})
MAX_DROPS = 8  # more refusals than this means the body itself is wrong, not a field
UPSTREAM_TIMEOUT_S = 600.0


class RecorderError(Exception):
    """A request the recorder cannot record faithfully; answered with an error status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


# ---------------------------------------------------------------------------------------
# Tag paths
# ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Tag:
    """Who sent a request, from its tag path."""
    app: str
    run: str
    agent: str
    round: str | None


def parse_tag_path(path: str) -> tuple[Tag, str]:
    """Split `/tag/<app>/<run>/<agent>/<round>/v1/...` into the tag and the OpenAI path
    (`/v1/...`); the query string is ignored (OpenAI clients send none)."""
    path = urllib.parse.urlsplit(path).path
    if not path.startswith(TAG_PREFIX):
        raise RecorderError(404, f"not a tag path: {path}")
    parts = path[len(TAG_PREFIX):].split("/")
    if len(parts) < 6 or parts[4] != "v1" or not all(parts[:4]):
        raise RecorderError(404, f"a tag path is /tag/<app>/<run>/<agent>/<round>/v1/...: {path}")
    app, run, agent, round_ = (urllib.parse.unquote(p) for p in parts[:4])
    return Tag(app, run, agent, None if round_ == NO_ROUND else round_), "/" + "/".join(parts[4:])


# ---------------------------------------------------------------------------------------
# Answers: forwarded or scripted, and their SSE form
# ---------------------------------------------------------------------------------------

@dataclass
class Answer:
    """One chat answer in the OpenAI shape, whatever produced it."""
    content: str | None
    tool_calls: list[dict[str, Any]] | None
    finish_reason: str
    scripted: bool
    id: str
    created: int
    usage: dict[str, Any] | None

    def record(self) -> dict[str, Any]:
        return {"content": self.content, "tool_calls": self.tool_calls,
                "finish_reason": self.finish_reason, "scripted": self.scripted}

    def completion(self, model: str) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        body: dict[str, Any] = {
            "id": self.id, "object": "chat.completion", "created": self.created, "model": model,
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": self.finish_reason}],
        }
        if self.usage is not None:
            body["usage"] = self.usage
        return body


def scripted_answer(step: dict[str, Any], run: str, agent: str, k: int) -> Answer:
    """The tool calls a script gives the k-th request of an agent, with ids that are the
    same on every capture (`call_<run>_<agent>_<k>_<i>`)."""
    calls = step.get("tool_calls")
    if not isinstance(calls, list) or not calls:
        raise RecorderError(400, f"a script step needs a non-empty tool_calls list: {step!r}")
    tool_calls = []
    for i, call in enumerate(calls):
        arguments = call.get("arguments", {})
        tool_calls.append({
            "id": f"call_{run}_{agent}_{k}_{i}",
            "type": "function",
            "function": {"name": call["name"],
                         "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)},
        })
    usage = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    return Answer(None, tool_calls, "tool_calls", True, f"chatcmpl-scripted-{run}-{agent}-{k}",
                  int(time.time()), usage)


_PIECE = re.compile(r"\s*\S+|\s+")


def content_pieces(text: str) -> list[str]:
    """The answer cut where a token stream would plausibly cut it (a word and the space
    before it), so clients see several content deltas like from a real engine."""
    return _PIECE.findall(text)


def sse_events(answer: Answer, model: str, include_usage: bool) -> Iterator[dict[str, Any]]:
    """The chat.completion.chunk objects of a stream carrying `answer`: a role delta,
    content deltas, tool-call deltas, the finish chunk, and the usage chunk if asked."""
    envelope = {"id": answer.id, "object": "chat.completion.chunk", "created": answer.created, "model": model}

    def chunk(delta: dict[str, Any], finish_reason: str | None) -> dict[str, Any]:
        return {**envelope, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                         "finish_reason": finish_reason}]}

    yield chunk({"role": "assistant", "content": ""}, None)
    for piece in content_pieces(answer.content or ""):
        yield chunk({"content": piece}, None)
    for index, call in enumerate(answer.tool_calls or []):
        # The name and id first, the arguments after, as OpenAI streams them.
        yield chunk({"tool_calls": [{"index": index, "id": call["id"], "type": "function",
                                     "function": {"name": call["function"]["name"], "arguments": ""}}]}, None)
        yield chunk({"tool_calls": [{"index": index, "function": {"arguments": call["function"]["arguments"]}}]},
                    None)
    yield chunk({}, answer.finish_reason)
    if include_usage:
        yield {**envelope, "choices": [], "usage": answer.usage}


def sse_payload(answer: Answer, model: str, include_usage: bool) -> bytes:
    lines = [f"data: {json.dumps(event)}\n\n" for event in sse_events(answer, model, include_usage)]
    lines.append("data: [DONE]\n\n")
    return "".join(lines).encode()


class Upstream:
    """The real model's OpenAI server, asked non-streamed."""

    def __init__(self, base_url: str) -> None:
        parts = urllib.parse.urlsplit(base_url.rstrip("/"))
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"the upstream must be an http:// URL: {base_url}")
        # The server's root: paths below are the OpenAI ones, /v1 included.
        self.host, self.port, self.prefix = parts.hostname, parts.port or 80, parts.path.removesuffix("/v1")

    def _call(self, method: str, path: str, body: dict[str, Any] | None) -> tuple[int, dict[str, Any]]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=UPSTREAM_TIMEOUT_S)
        try:
            payload = None if body is None else json.dumps(body).encode()
            headers = {"content-type": "application/json"} if payload is not None else {}
            conn.request(method, self.prefix + path, body=payload, headers=headers)
            response = conn.getresponse()
            raw = response.read()
        except OSError as exc:  # refused, reset, timed out: the client gets a 502, the capture a failure
            raise RecorderError(502, f"the upstream is unreachable: {exc!r}") from exc
        finally:
            conn.close()
        try:
            return response.status, json.loads(raw)
        except json.JSONDecodeError as exc:
            raise RecorderError(502, f"the upstream answered {response.status} with a non-JSON body") from exc

    def models(self) -> tuple[int, dict[str, Any]]:
        return self._call("GET", "/v1/models", None)

    def chat(self, body: dict[str, Any]) -> tuple[Answer, list[str]]:
        """The upstream's answer to `body` and the fields dropped to get one: each 400
        naming a top-level field of the body drops that field and asks again."""
        forward = {k: v for k, v in body.items() if k != "stream_options"}
        forward["stream"] = False
        dropped: list[str] = []
        for _ in range(MAX_DROPS + 1):
            status, reply = self._call("POST", "/v1/chat/completions", forward)
            if status == 200:
                return _answer_from_completion(reply), dropped
            param = _refused_field(status, reply)
            if param is None or param not in forward or param in ESSENTIAL_FIELDS or param == "stream":
                raise RecorderError(status, f"the upstream refused the request: {json.dumps(reply)[:500]}")
            dropped.append(param)
            del forward[param]
        raise RecorderError(502, f"the upstream kept refusing fields after dropping {dropped}")


def _refused_field(status: int, reply: dict[str, Any]) -> str | None:
    """The top-level body field an OpenAI 400 names (`param` "a.b.c" -> "a"), if any."""
    if status != 400:
        return None
    error = reply.get("error")
    param = error.get("param") if isinstance(error, dict) else None
    return param.split(".", 1)[0] if isinstance(param, str) and param else None


def _answer_from_completion(reply: dict[str, Any]) -> Answer:
    choice = reply["choices"][0]
    message = choice.get("message") or {}
    return Answer(message.get("content"), message.get("tool_calls") or None, choice.get("finish_reason") or "stop",
                  False, reply.get("id", "chatcmpl-recorded"), int(reply.get("created", time.time())),
                  reply.get("usage"))


# ---------------------------------------------------------------------------------------
# Capture state
# ---------------------------------------------------------------------------------------

@dataclass
class Capture:
    """Everything recorded since the last save, shared by the handler threads. Its clock
    starts at its first event (a run registered or a request), so a capture's times do
    not count the wait before its app started."""
    started: float | None = None
    seq: Iterator[int] = field(default_factory=itertools.count)
    records: list[dict[str, Any]] = field(default_factory=list)
    failures: list[dict[str, Any]] = field(default_factory=list)
    runs: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)  # app -> run -> info
    scripts: dict[tuple[str, str, str], list[dict[str, Any] | None]] = field(default_factory=dict)
    counts: dict[tuple[str, str, str], int] = field(default_factory=dict)
    models_calls: int = 0

    def now(self) -> float:
        if self.started is None:
            self.started = time.monotonic()
        return round(time.monotonic() - self.started, 6)


class Recorder:
    """The recorder's behaviour, independent of HTTP plumbing."""

    def __init__(self, upstream: Upstream) -> None:
        self.upstream = upstream
        self.lock = threading.Lock()
        self.capture = Capture()

    # -- control ---------------------------------------------------------------------
    def register_run(self, data: dict[str, Any]) -> dict[str, Any]:
        app, run, task = str(data["app"]), str(data["run"]), data["task"]
        if not isinstance(task, str):
            raise RecorderError(400, "task must be a string")
        group = data.get("concurrent_group")
        with self.lock:
            self.capture.now()  # starts the clock
            self.capture.runs.setdefault(app, {})[run] = {"task": task, "concurrent_group": group}
        return {"ok": True}

    def register_script(self, data: dict[str, Any]) -> dict[str, Any]:
        key = (str(data["app"]), str(data["run"]), str(data["agent"]))
        steps = data["steps"]
        if not isinstance(steps, list) or not all(s is None or isinstance(s, dict) for s in steps):
            raise RecorderError(400, "steps must be a list of objects or nulls")
        with self.lock:
            self.capture.scripts[key] = steps
        return {"ok": True}

    def save(self, data: dict[str, Any]) -> dict[str, Any]:
        """Write the capture of one app (header, then requests by seq) and start afresh.
        Refused while a request failed: a capture with holes is not ground truth."""
        workload = str(data["workload"])
        with self.lock:
            capture, self.capture = self.capture, Capture()
        if capture.failures:
            raise RecorderError(409, f"{len(capture.failures)} request(s) failed, not saved: "
                                     f"{json.dumps(capture.failures)[:1000]}")
        foreign = sorted({r["app"] for r in capture.records} - {workload})
        if foreign:
            raise RecorderError(409, f"the capture holds requests of other apps: {foreign}")
        header = {"workload": workload, "framework": data["framework"], "description": data["description"],
                  "model": data["model"], "runs": capture.runs.get(workload, {})}
        records = sorted(capture.records, key=lambda r: r["seq"])
        path = Path(data["path"])
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", encoding="utf-8") as out:
            for obj in [header, *records]:
                out.write(json.dumps(obj, ensure_ascii=False, sort_keys=False) + "\n")
        return {"ok": True, "requests": len(records), "models_calls": capture.models_calls, "path": str(path)}

    # -- traffic ---------------------------------------------------------------------
    def chat(self, tag: Tag, headers: dict[str, str], body: dict[str, Any]) -> tuple[Answer, dict[str, Any]]:
        """Answer one chat request (scripted or forwarded) and record it."""
        with self.lock:
            capture = self.capture
            seq = next(capture.seq)
            t_start = capture.now()
            key = (tag.app, tag.run, tag.agent)
            k = capture.counts.get(key, 0)
            capture.counts[key] = k + 1
            steps = capture.scripts.get(key, [])
            step = steps[k] if k < len(steps) else None
        record: dict[str, Any] = {
            "seq": seq, "app": tag.app, "run": tag.run, "agent": tag.agent, "round": tag.round,
            "t_start": t_start, "t_end": None, "path": "/v1/chat/completions",
            "headers": {k: v for k, v in headers.items() if k not in UNRECORDED_HEADERS},
            "body": body, "dropped": [], "response": None, "quotes": [],
        }
        try:
            if step is not None:
                answer = scripted_answer(step, tag.run, tag.agent, k)
            else:
                answer, record["dropped"] = self.upstream.chat(body)
        except (RecorderError, OSError, KeyError, IndexError, TypeError) as exc:
            # Kept, so that save() refuses a capture with a hole in it.
            with self.lock:
                capture.failures.append({"seq": seq, "tag": tag.__dict__, "error": repr(exc)})
            if isinstance(exc, RecorderError):
                raise
            raise RecorderError(502, f"answering failed: {exc!r}") from exc
        record["response"] = answer.record()
        return answer, record

    def finish(self, record: dict[str, Any]) -> None:
        """Stamp the end (the answer is fully written) and keep the record."""
        with self.lock:
            record["t_end"] = self.capture.now()
            self.capture.records.append(record)

    def count_models_call(self) -> None:
        with self.lock:
            self.capture.models_calls += 1


# ---------------------------------------------------------------------------------------
# HTTP
# ---------------------------------------------------------------------------------------

class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the frameworks' HTTP clients expect
    server: RecorderServer

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
        if self.server.verbose:
            super().log_message(format, *args)

    def _send(self, status: int, payload: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(payload)))
        if content_type == "text/event-stream":
            self.send_header("cache-control", "no-cache")
        self.end_headers()
        self.wfile.write(payload)
        self.wfile.flush()

    def _send_json(self, status: int, obj: dict[str, Any]) -> None:
        self._send(status, json.dumps(obj).encode())

    def _send_error(self, status: int, message: str) -> None:
        self._send_json(status, {"error": {"message": message, "type": "invalid_request_error",
                                           "param": None, "code": None}})

    def _read_json(self) -> dict[str, Any]:
        length = int(self.headers.get("content-length") or 0)
        raw = self.rfile.read(length)
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise RecorderError(400, "the body is not valid JSON") from exc
        if not isinstance(data, dict):
            raise RecorderError(400, "the body must be a JSON object")
        return data

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        try:
            _, path = parse_tag_path(self.path)
            if path != "/v1/models":
                raise RecorderError(404, f"no GET {path}")
            self.server.recorder.count_models_call()
            status, reply = self.server.recorder.upstream.models()
            self._send_json(status, reply)
        except RecorderError as exc:
            self._send_error(exc.status, str(exc))

    def do_POST(self) -> None:  # noqa: N802
        recorder = self.server.recorder
        try:
            data = self._read_json()
            control = {"/_run": recorder.register_run, "/_script": recorder.register_script, "/_save": recorder.save}
            if self.path in control:
                try:
                    self._send_json(200, control[self.path](data))
                except KeyError as exc:
                    raise RecorderError(400, f"missing field {exc}") from exc
                return
            tag, path = parse_tag_path(self.path)
            if path != "/v1/chat/completions":
                raise RecorderError(404, f"no POST {path}")
            headers = {k.lower(): v for k, v in self.headers.items()}
            answer, record = recorder.chat(tag, headers, data)
            model = str(data.get("model", ""))
            if data.get("stream"):
                options = data.get("stream_options")
                include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
                self._send(200, sse_payload(answer, model, include_usage), "text/event-stream")
            else:
                self._send_json(200, answer.completion(model))
            recorder.finish(record)
        except RecorderError as exc:
            print(f"recorder: {self.path}: {exc}", file=sys.stderr, flush=True)
            self._send_error(exc.status, str(exc))


class RecorderServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], recorder: Recorder, verbose: bool = False) -> None:
        super().__init__(address, Handler)
        self.recorder = recorder
        self.verbose = verbose

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"


def make_server(upstream_url: str, host: str = "127.0.0.1", port: int = 0, verbose: bool = False) -> RecorderServer:
    """A recorder bound to loopback (port 0: any free port); call serve_forever()."""
    return RecorderServer((host, port), Recorder(Upstream(upstream_url)), verbose)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--upstream", required=True, help="the model's base URL, e.g. http://127.0.0.1:8001")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args()
    server = make_server(args.upstream, args.host, args.port, args.verbose)
    print(f"recorder listening on {server.url}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("recorder stopped", file=sys.stderr)  # Ctrl-C is how a person ends it
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
