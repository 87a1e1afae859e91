"""Schemathesis against the engine's own OpenAPI (a bounded run, part of every suite run):
requests generated from the schema, valid and not, never get a server error, and every
answer matches what the schema declares. A longer run: KVRELAY_FUZZ_EXAMPLES=500."""

from __future__ import annotations

from benchmarks.fuzz import fuzz_openapi
from tests.helpers import make_engine

MODEL = "tiny"


def test_the_engine_never_errors_and_keeps_to_its_schema(llama_dir, run_server):
    with run_server(make_engine(llama_dir, 64, name=MODEL), MODEL) as srv:
        result = fuzz_openapi(f"{srv.base_url}/openapi.json")
    assert result.num_operations >= 4 and result.num_cases >= 4 * 10
    assert result.failures == [], "\n".join(result.failures)
