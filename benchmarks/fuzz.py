"""Schemathesis, driven from plain code (the suite's fuzz tests and `kvrelay bench
reliability`): every operation of a live server's OpenAPI, `examples` generated cases
each (positive and negative), every check run, failures collected as one line each
rather than stopping at the first."""

from __future__ import annotations

import os
from typing import NamedTuple

import hypothesis
import schemathesis
from schemathesis import checks

EXAMPLES = int(os.environ.get("KVRELAY_FUZZ_EXAMPLES", "25"))  # a longer run: KVRELAY_FUZZ_EXAMPLES=500
CHECKS = [checks.not_a_server_error, checks.response_schema_conformance, checks.content_type_conformance,
          checks.status_code_conformance]


class FuzzResult(NamedTuple):
    num_operations: int
    num_cases: int
    failures: list[str]

    @property
    def num_server_errors(self) -> int:
        return sum(": ServerError:" in f for f in self.failures)


def fuzz_openapi(url: str, examples: int = EXAMPLES, headers: dict[str, str] | None = None) -> FuzzResult:
    schema = schemathesis.openapi.from_url(url)
    num_operations, num_cases, failures = 0, 0, []
    for found in schema.get_all_operations():
        operation = found.ok()
        num_operations += 1

        @hypothesis.given(case=operation.as_strategy())
        @hypothesis.settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                             suppress_health_check=list(hypothesis.HealthCheck))
        def run(case: schemathesis.Case) -> None:
            nonlocal num_cases
            num_cases += 1
            try:
                case.call_and_validate(checks=CHECKS, headers=headers)
            except (checks.FailureGroup, checks.Failure) as exc:
                found = exc.exceptions if isinstance(exc, checks.FailureGroup) else [exc]
                failures.extend(f"{operation.label}: {type(f).__name__}: {str(f).splitlines()[0]}" for f in found)

        run()
    return FuzzResult(num_operations, num_cases, failures)
