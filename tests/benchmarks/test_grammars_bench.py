"""`kvrelay bench grammars`: the llguidance probe, run as the bench runs it, on the tiny tokenizer."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from benchmarks import BENCHMARKS
from benchmarks.grammar_probe import BACKENDS, byte_vocab, walk
from benchmarks.grammars import build_job, invalid_instances, probe_library, summarize
from benchmarks.json_schemas import seeded_schemas

pytest.importorskip("llguidance")


@pytest.fixture(scope="module")
def tokenizer_json(tiny_tokenizer_dir):
    return tiny_tokenizer_dir[0] / "tokenizer.json"


def test_the_bench_is_registered():
    assert BENCHMARKS["grammars"] == "benchmarks.grammars"


def test_llguidance_probe_on_three_schemas(tokenizer_json):
    schemas = seeded_schemas(3)
    result = probe_library("llguidance", tokenizer_json, schemas)
    assert result["status"] == "ok" and result["setup_ms"] > 0
    assert [c["index"] for c in result["cases"]] == [0, 1, 2]
    vocab_size = build_job("llguidance", tokenizer_json, schemas)["vocab_size"]
    for case in result["cases"]:
        assert "error" not in case and case["compile_ms"] > 0 and case["complete"]
        assert len(case["mask_us"]) > 10 and min(case["mask_us"]) > 0
        assert 0 < case["first_allowed"] < vocab_size  # a real mask, neither empty nor all ones
        assert set(case["invalid_accepted"]) == set(invalid_instances(schemas[case["index"]]))
        assert not any(case["invalid_accepted"].values())  # llguidance enforces maximum and maxLength
    assert result["embedded"]["complete"]
    metrics = summarize(result, schemas)
    json.dumps(metrics)
    assert 0.0 <= metrics["llguidance_coverage"] <= 1.0 and metrics["llguidance_coverage"] == 1.0
    assert metrics["llguidance_rejected_valid_tokens"] == 0
    assert metrics["llguidance_mask_us_p99"] >= metrics["llguidance_mask_us_p50"] > 0
    assert metrics["llguidance_compile_ms_p50"] > 0


def test_a_forbidden_token_is_counted_as_rejected(tokenizer_json):
    """The rejection count is real: an output that is not JSON is stopped at its first token."""
    job = build_job("llguidance", tokenizer_json, seeded_schemas(1))
    tokens, specials = byte_vocab(json.loads(tokenizer_json.read_text()))
    backend = BACKENDS["llguidance"](job, tokens, specials)
    buf = np.zeros((1, (job["vocab_size"] + 31) // 32), dtype=np.int32)
    valid = walk(backend, backend.compile(job["cases"][0]["schema"]), job["cases"][0]["tokens"], job["eos"], buf)
    assert valid["complete"] and valid["rejected"] == 0
    not_json = [i for i, t in enumerate(tokens) if t == b"x"]
    invalid = walk(backend, backend.compile(job["cases"][0]["schema"]), not_json, job["eos"], buf)
    assert invalid["rejected"] == 1 and invalid["rejected_at"] == 0 and not invalid["complete"]
    early_eos = walk(backend, backend.compile(job["cases"][0]["schema"]), job["cases"][0]["tokens"][:3], job["eos"], buf)
    assert early_eos["rejected"] == 1 and early_eos["rejected_at"] == 3


def test_each_invalid_instance_breaks_only_its_keyword():
    kinds = [kind for schema in seeded_schemas() for kind in invalid_instances(schema)]
    assert kinds.count("string_too_long") >= 20 and kinds.count("number_above_maximum") >= 20
    schema = seeded_schemas(1)[0]
    validator = jsonschema.Draft202012Validator(schema)
    for kind, instance in invalid_instances(schema).items():
        keywords = {error.validator for error in validator.iter_errors(instance)}
        assert keywords == {"maximum" if kind == "number_above_maximum" else "maxLength"}


def test_a_library_nobody_has_is_not_installed(tokenizer_json, monkeypatch):
    monkeypatch.setattr("benchmarks.grammars.library_python", lambda module: None)
    assert probe_library("xgrammar", tokenizer_json, seeded_schemas(1))["status"] == "not installed"
