"""End-to-end tests cross components (client, gateway, engine, SQL, frameworks): they use
the gateway tests' loopback fixtures, imported here so both suites share one copy."""

from tests.gateway.conftest import _servers, clean_env, db_url, fake_upstream, start_gateway  # noqa: F401
