"""Schemathesis against the gateway's OpenAPI (a bounded run, part of every suite run),
admin API included: no generated request, valid or not, gets a server error, and every
answer matches what the schema declares. A longer run: KVRELAY_FUZZ_EXAMPLES=500."""

from __future__ import annotations

from benchmarks.fuzz import fuzz_openapi

ADMIN = "admin-" + "s3cret" * 4


def test_the_gateway_never_errors_and_keeps_to_its_schema(fake_upstream, start_gateway):
    gw = start_gateway([fake_upstream().url], admin_key=ADMIN)
    result = fuzz_openapi(f"{gw.url}/openapi.json", headers={"Authorization": f"Bearer {ADMIN}"})
    assert result.num_operations >= 10 and result.num_cases >= 10 * 10
    assert result.failures == [], "\n".join(sorted(set(result.failures)))
