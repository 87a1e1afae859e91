"""`kvrelay bench grammars`: three grammar libraries for constrained decoding, on CPU.

llguidance, xgrammar and outlines-core each compile the 50 seeded schemas of
benchmarks/json_schemas.py (--quick: 10) for the default model's tokenizer, then walk a
valid instance of each (its compact JSON, tokenized by that tokenizer) through the
matcher, filling the full token bitmask before every token as a sampler does per decode
step. Reported per library (one column each): how many schemas compile, compile time,
the one-time tokenizer setup, mask time per token, and valid tokens the mask forbade (a
correctness failure: the library would keep the model from writing a valid answer).
Compiling is not enforcing, so each schema also gets instances that break one keyword (a
number past its maximum, a string past its maxLength); one that reaches EOS means the
library silently drops that keyword. A last walk puts a tool call's JSON inside free
text, to check the library can embed JSON in a larger grammar.

xgrammar and outlines-core live only in the vLLM venv, so each library runs in a child
process of a python that can import it (benchmarks/grammar_probe.py, which imports
nothing from kvrelay). A schema that runs past CASE_TIMEOUT_S is killed with its child
and counted as not compiled; the child restarts from the next schema.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np

from benchmarks.common import BenchResult
from benchmarks.grammar_probe import TOOL_BEGIN, TOOL_END
from benchmarks.json_schemas import example_instance, seeded_schemas
from engine_ext.model_store import resolve_model
from engine_ext.vllm.server import find_vllm_python

LIBRARIES = ("llguidance", "xgrammar", "outlines_core")  # module names, and the metrics' prefixes
EMBEDDING: dict[str, str] = {"llguidance": "Lark CFG with %json", "xgrammar": "structural tag",
                             "outlines_core": "regex concatenation only"}
PROBE = Path(__file__).with_name("grammar_probe.py")
REPO = Path(__file__).resolve().parent.parent
EOS_TOKEN = "<|im_end|>"
CASE_TIMEOUT_S = 120.0


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def build_job(library: str, tokenizer_json: Path, schemas: list[dict]) -> dict:
    """The probe's input: each schema with its full valid instance's token ids, and the tool call."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    eos = tok.token_to_id(EOS_TOKEN)
    if eos is None:
        raise ValueError(f"{tokenizer_json} has no {EOS_TOKEN} token")

    def encode(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False).ids

    cases = [{"index": i, "schema": s, "tokens": encode(_compact(example_instance(s, full=True))),
              "invalid": {kind: encode(_compact(bad)) for kind, bad in invalid_instances(s).items()}}
             for i, s in enumerate(schemas)]
    call = f"I will look that up.{TOOL_BEGIN}{_compact(example_instance(schemas[0], full=True))}{TOOL_END}"
    return {"library": library, "tokenizer_json": str(tokenizer_json), "eos": eos,
            "vocab_size": tok.get_vocab_size(with_added_tokens=True), "cases": cases,
            "embedded": {"schema": schemas[0], "tokens": encode(call)}}


def _leaves(value: Any, path: tuple = ()) -> list[tuple[tuple, Any]]:
    if isinstance(value, dict):
        return [leaf for k, v in value.items() for leaf in _leaves(v, (*path, k))]
    if isinstance(value, list):
        return [leaf for i, v in enumerate(value) for leaf in _leaves(v, (*path, i))]
    return [(path, value)]


def _replaced(value: Any, path: tuple, new: Any) -> Any:
    if not path:
        return new
    copy = dict(value) if isinstance(value, dict) else list(value)
    copy[path[0]] = _replaced(value[path[0]], path[1:], new)
    return copy


def invalid_instances(schema: dict) -> dict[str, Any]:
    """The full valid instance with one leaf broken: a number past its maximum, a string past its
    maxLength; each kept only when jsonschema says that keyword, and nothing else, fails."""
    instance = example_instance(schema, full=True)
    validator = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    found: dict[str, Any] = {}
    for path, leaf in _leaves(instance):
        if isinstance(leaf, bool) or not isinstance(leaf, (int, float, str)):
            continue
        kind, keyword, bad = (("string_too_long", "maxLength", "x" * 60) if isinstance(leaf, str)
                              else ("number_above_maximum", "maximum", 10**6))
        if kind not in found:
            broken = _replaced(instance, path, bad)
            errors = list(validator.iter_errors(broken))
            if errors and all(e.validator == keyword for e in errors):
                found[kind] = broken
    return found


def library_python(module: str) -> Path | None:
    """This interpreter if it can import `module`, else the vLLM venv's python (it may not either)."""
    if importlib.util.find_spec(module) is not None:
        return Path(sys.executable)
    with contextlib.chdir(REPO):  # .venv-vllm is found relative to the repo root, wherever the bench runs
        vllm_python = find_vllm_python()
        return vllm_python.absolute() if vllm_python is not None else None


def _run_child(python: Path, job: dict, timeout_s: float) -> tuple[list[dict], str | None]:
    """The probe's events, and why it stopped early (None when it reported "done")."""
    with tempfile.TemporaryFile(mode="w+") as stderr:
        child = subprocess.Popen([str(python), str(PROBE)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=stderr, text=True)
        lines: queue.Queue[str | None] = queue.Queue()

        def pump() -> None:
            assert child.stdout is not None
            for line in child.stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=pump, daemon=True).start()
        assert child.stdin is not None
        child.stdin.write(json.dumps(job))
        child.stdin.close()
        events: list[dict] = []
        while True:
            try:
                line = lines.get(timeout=timeout_s)
            except queue.Empty:
                child.kill()
                child.wait()
                return events, f"timed out after {timeout_s:.0f} s"
            if line is None:
                break
            if line.startswith('{"event"'):  # not whatever a library prints on its own
                events.append(json.loads(line))
        rc = child.wait()
        if events and events[-1]["event"] == "done":
            return events, None
        stderr.seek(0)
        return events, f"probe exited with rc={rc}: {stderr.read()[-400:].strip()}"


def probe_library(library: str, tokenizer_json: Path, schemas: list[dict],
                  case_timeout_s: float = CASE_TIMEOUT_S) -> dict:
    """One library over the schemas: {"status", "version", "setup_ms", "cases", "embedded"}."""
    python = library_python(library)
    if python is None:
        return {"library": library, "status": "not installed", "cases": []}
    job = build_job(library, tokenizer_json, schemas)
    result: dict[str, Any] = {"library": library, "status": "ok", "python": str(python), "cases": []}
    pending = job["cases"]
    while True:
        events, failure = _run_child(python, {**job, "cases": pending}, case_timeout_s)
        for event in events:
            if event["event"] == "setup" and "error" in event:
                return {**result, "status": event["error"]}
            if event["event"] == "setup" and "setup_ms" not in result:
                result.update(version=event["version"], setup_ms=event["setup_ms"], vocab_ms=event["vocab_ms"])
            elif event["event"] == "case":
                result["cases"].append(event)
            elif event["event"] == "embedded":
                result["embedded"] = event
        if failure is None:
            return result
        if not any(e["event"] == "setup" for e in events):
            return {**result, "status": failure}
        done = {c["index"] for c in result["cases"]}
        pending = [c for c in pending if c["index"] not in done]
        if not pending:  # it failed on the embedded walk
            result["embedded"] = {"event": "embedded", "error": failure}
            return result
        result["cases"].append({"event": "case", "index": pending[0]["index"], "error": failure})
        pending = pending[1:]


def summarize(result: dict, schemas: list[dict]) -> dict[str, float]:
    """The library's metrics, named `<library>_<metric>`; none for a library that did not run."""
    if result["status"] != "ok":
        return {}
    cases = result["cases"]
    compiled = [c for c in cases if "error" not in c]
    compile_ms = [c["compile_ms"] for c in compiled] or [float("nan")]
    # llguidance builds its lexer lazily, at the first masks: what a request waits for its first token
    first_ms = [c["compile_ms"] + c["mask_us"][0] / 1e3 for c in compiled] or [float("nan")]
    mask_us = [t for c in compiled for t in c["mask_us"]] or [float("nan")]
    embedded = result.get("embedded", {})
    name = result["library"]
    return {f"{name}_coverage": len(compiled) / len(schemas),
            f"{name}_failed_schemas": float(len(cases) - len(compiled)),
            f"{name}_setup_ms": result["setup_ms"],
            f"{name}_compile_ms_p50": float(np.percentile(compile_ms, 50)),
            f"{name}_compile_ms_p90": float(np.percentile(compile_ms, 90)),
            f"{name}_first_mask_ms_p50": float(np.percentile(first_ms, 50)),
            f"{name}_mask_us_p50": float(np.percentile(mask_us, 50)),
            f"{name}_mask_us_p99": float(np.percentile(mask_us, 99)),
            f"{name}_masks": float(len(mask_us) if compiled else 0),
            f"{name}_rejected_valid_tokens": float(sum(c["rejected"] for c in compiled)),
            f"{name}_incomplete_walks": float(sum(not c["complete"] for c in compiled)),
            f"{name}_invalid_walks": float(sum(len(c["invalid_accepted"]) for c in compiled)),
            f"{name}_invalid_accepted": float(sum(sum(c["invalid_accepted"].values()) for c in compiled)),
            f"{name}_embedded_json_ok": float(embedded.get("complete", False))}


def _column(result: dict, metrics: dict[str, float], n: int) -> list[str]:
    name = result["library"]
    if result["status"] != "ok":
        return [result["status"][:60], "", "", "", "", "", "", "", ""]
    m = {k.removeprefix(f"{name}_"): v for k, v in metrics.items()}
    embedded = result.get("embedded", {})
    check = "verified" if embedded.get("complete") else f"FAILED ({embedded.get('error', 'token rejected')[:40]})"
    return [result["version"], f"{m['coverage'] * n:.0f}/{n} ({m['failed_schemas']:.0f} raised or timed out)",
            f"{m['setup_ms']:.0f}", f"{m['compile_ms_p50']:.1f} / {m['compile_ms_p90']:.1f}",
            f"{m['first_mask_ms_p50']:.1f}",
            f"{m['mask_us_p50']:.1f} / {m['mask_us_p99']:.1f}",
            f"{m['rejected_valid_tokens']:.0f} ({m['incomplete_walks']:.0f} walks incomplete)",
            f"{m['invalid_accepted']:.0f} of {m['invalid_walks']:.0f}{_ignored(result)}",
            f"{EMBEDDING[name]}: {check}"]


def _ignored(result: dict) -> str:
    kinds = sorted({k for c in result["cases"] for k, ok in c.get("invalid_accepted", {}).items() if ok})
    return f" ({', '.join(kinds)})" if kinds else ""


def run(quick: bool, model: str | None) -> BenchResult:
    schemas = seeded_schemas(10 if quick else 50)
    tokenizer_json = resolve_model(model) / "tokenizer.json"
    results = [probe_library(name, tokenizer_json, schemas) for name in LIBRARIES]
    metrics: dict[str, float] = {}
    columns = []
    for result in results:
        library_metrics = summarize(result, schemas)
        metrics.update(library_metrics)
        columns.append(_column(result, library_metrics, len(schemas)))
    measures = ["version", "schemas compiled", "tokenizer setup ms", "compile ms p50 / p90",
                "compile + first mask ms p50", "mask µs per token p50 / p99", "valid tokens rejected", "invalid instances accepted",
                "JSON inside a larger grammar"]
    rows = [(measure, *(col[i] for col in columns)) for i, measure in enumerate(measures)]
    failures = {r["library"]: {schemas[c["index"]]["title"] + f" #{c['index']}": c["error"]
                               for c in r["cases"] if "error" in c} for r in results}
    config = {"quick": quick, "schemas": len(schemas), "tokenizer": str(tokenizer_json), "eos": EOS_TOKEN,
              "case_timeout_s": CASE_TIMEOUT_S, "grammar": "compact JSON, properties in declared order",
              "options": "library defaults otherwise (xgrammar: 8 compiler threads, cache off)",
              "libraries": {r["library"]: {k: r.get(k) for k in ("status", "version", "python", "vocab_ms")}
                            for r in results},
              "failures": failures, "embedded": {r["library"]: r.get("embedded", {}).get("error") for r in results},
              "cpu_count": os.cpu_count()}
    return BenchResult("grammars", metrics, config, rows,
                       headers=("measure", "llguidance", "xgrammar", "outlines-core"))
