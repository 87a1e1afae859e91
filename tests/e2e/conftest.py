"""End-to-end tests cross components (client, gateway, engine, SQL, frameworks): they use
the gateway tests' loopback fixtures, imported here so both suites share one copy."""

from collections.abc import Callable
from typing import Any

import pytest

from kvrelay.gateway.settings import Timeouts
from tests.gateway.conftest import Gateway, _servers, clean_env, db_url, fake_upstream  # noqa: F401
from tests.gateway.conftest import start_gateway as _gateway_factory  # noqa: F401

# A real engine generates a whole non-streamed answer before its first byte, on a shared
# two-core CI machine; the gateway suite's 5 s (made for fake upstreams) is not a bound on that.
ENGINE_TIMEOUTS = Timeouts(connect_s=5.0, first_byte_s=120.0, idle_s=120.0, total_s=300.0)


@pytest.fixture
def start_gateway(_gateway_factory: Callable[..., Gateway]) -> Callable[..., Gateway]:  # noqa: F811
    """The gateway suite's factory with timeouts sized for real engines unless overridden."""
    def start(upstreams: list[str], **settings: Any) -> Gateway:
        settings.setdefault("timeouts", ENGINE_TIMEOUTS)
        return _gateway_factory(upstreams, **settings)

    return start
