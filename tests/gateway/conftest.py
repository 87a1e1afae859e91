"""Fixtures for the gateway tests: fake upstreams and gateways on loopback ports."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from opentelemetry.sdk.trace import TracerProvider

from kvrelay.gateway import GatewaySettings, create_app
from kvrelay.gateway.call import GatewayState
from kvrelay.gateway.settings import Timeouts
from kvrelay.gateway.storage import migrate
from tests.gateway.support import Behaviour, FakeUpstream, LoopbackServer, stop_all, wait_rows

PG_URL = os.environ.get("KVRELAY_TEST_POSTGRES_URL")
PG_CTL = os.environ.get("KVRELAY_TEST_PG_CTL")
needs_pg = pytest.mark.skipif(not PG_URL, reason="no PostgreSQL (run through scripts/with-postgres.sh, as make test does)")
FAST_TIMEOUTS = Timeouts(connect_s=1.0, first_byte_s=5.0, idle_s=5.0, total_s=30.0)


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=needs_pg)])
def db_url(request, tmp_path) -> str:
    if request.param == "sqlite":
        url = f"sqlite+aiosqlite:///{tmp_path}/records.db"
    else:
        url = PG_URL
        migrate.downgrade(url, "base")  # a clean schema for every test
    migrate.upgrade(url)
    return url


@dataclass
class Gateway:
    url: str
    app: FastAPI
    db_path: Path
    server: LoopbackServer

    @property
    def v1(self) -> str:
        return self.url + "/v1"

    @property
    def state(self) -> GatewayState:
        return self.app.state.gateway

    @property
    def pool(self):
        return self.state.upstreams.pool

    def rows(self, n: int, timeout: float = 5.0, settle: float = 0.05):
        return wait_rows(self.db_path, n, timeout, settle)

    def client(self, **kw: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=kw.pop("timeout", 30), **kw)


@pytest.fixture
def clean_env(monkeypatch):
    """No KVRELAY_* or OTEL_* variable from the outer environment leaks into a gateway."""
    import os

    for name in list(os.environ):
        if name.startswith(("KVRELAY_", "OTEL_")):
            monkeypatch.delenv(name)
    return monkeypatch


@pytest.fixture
def _servers() -> Iterator[list[LoopbackServer]]:
    """Every server a test started, stopped together at its end."""
    servers: list[LoopbackServer] = []
    yield servers
    stop_all(servers)


@pytest.fixture
def fake_upstream(_servers) -> Callable[..., FakeUpstream]:
    """Factory: fake_upstream(**Behaviour fields) -> a running FakeUpstream."""

    def start(**behaviour: Any) -> FakeUpstream:
        fake = FakeUpstream(Behaviour(**behaviour))
        _servers.append(fake.server)
        return fake

    return start


@pytest.fixture
def start_gateway(tmp_path, clean_env, _servers) -> Callable[..., Gateway]:
    """Factory: start_gateway([upstream urls], **GatewaySettings fields) -> a running Gateway
    with its own SQLite file (or `db_path`, to restart on the database of a stopped one),
    a 0.2 s health loop and short timeouts unless overridden (`database_url`: another database)."""
    counter = itertools.count()

    def start(upstreams: list[str], *, tracer_provider: TracerProvider | None = None, db_path: Path | None = None,
              database_url: str | None = None, **settings: Any) -> Gateway:
        db_path = db_path or tmp_path / f"gateway-{next(counter)}.sqlite"
        settings.setdefault("health_interval_s", 0.2)
        settings.setdefault("timeouts", FAST_TIMEOUTS)
        config = GatewaySettings(upstreams=upstreams, database_url=database_url or f"sqlite+aiosqlite:///{db_path}",
                                 **settings)
        app = create_app(config, tracer_provider=tracer_provider)
        server = LoopbackServer(app)
        _servers.append(server)
        return Gateway(server.url, app, db_path, server)

    return start

