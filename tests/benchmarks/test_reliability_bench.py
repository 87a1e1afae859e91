"""`kvrelay bench reliability --quick` on the tiny model, end to end: real engine and
gateway processes on loopback, the soak, every fault, the fuzzing (schemathesis and the
field fuzzing) and the state bound; its targets are the test's assertions."""

from __future__ import annotations

import json
import os

import pytest

from benchmarks import run_benchmark

pytestmark = pytest.mark.slow


def test_reliability_quick_meets_its_targets(llama_dir, tmp_path):
    # Under `make test` (scripts/with-postgres.sh) the PostgreSQL outage is one of the faults.
    with_postgres = bool(os.environ.get("KVRELAY_TEST_POSTGRES_URL") and os.environ.get("KVRELAY_TEST_PG_CTL"))
    out = tmp_path / "reliability.json"
    result = run_benchmark("reliability", quick=True, json_path=out, model=str(llama_dir))
    metrics = json.loads(out.read_text())["metrics"]
    assert metrics == result.metrics
    assert metrics["requests_sent"] >= 256 and metrics["requests_recorded"] == metrics["requests_sent"]
    assert metrics["errors"] == 0 and metrics["schema_violations"] == 0
    assert metrics["server_errors"] == 0 and metrics["records_lost"] == 0 and metrics["records_extra"] == 0, \
        [row for row in result.rows if "fuzz" in row[0]]
    assert metrics["fuzz_broken_batches"] == 0 and metrics["fuzz_timeouts"] == 0
    assert metrics["faults_injected"] == 4 + with_postgres and metrics["faults_survived"] == 4 + with_postgres, \
        [row for row in result.rows if "fault:" in row[0]]
    assert metrics["fuzz_cases"] >= 400 and metrics["schema_fuzz_cases"] > 50
    assert metrics["sessions_held"] <= metrics["sessions_bound"]
    assert metrics["rss_growth_pct"] < 100
