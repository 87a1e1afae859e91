"""The `kvrelay` command line. Each command reports bad input as one line and exit code 2."""

from __future__ import annotations

import logging
import math
import os
import secrets
import sys
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional, TypedDict, TypeVar

import typer

from kvrelay.engine_settings import EngineSettings  # torch-free: the engine's options, checked before it loads
from kvrelay.cli_flags import with_settings

if TYPE_CHECKING:  # the engine's modules load only in the commands that need them
    from fastapi import FastAPI

    from engine_ext.engine import LLMEngine
    from engine_ext.tools.formats.generic import AutoPolicy
    from kvrelay.gateway.auth import KeyStore
    from kvrelay.gateway.settings import GatewaySettings
    from kvrelay.wire.seal import PlanSeal

T = TypeVar("T")

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, help="kvrelay: KV-cache reuse for multi-agent LLM apps.")


def _fail(message: str) -> typer.Exit:
    typer.echo(f"kvrelay: error: {message}", err=True)
    return typer.Exit(code=2)


def _engine_extra_missing(exc: ModuleNotFoundError) -> typer.Exit:
    return _fail(f"the embedded engine needs the `engine` extra (pip install 'kvrelay[engine]'): {exc}")


def _build_engine(settings: EngineSettings) -> LLMEngine:
    """The engine the settings describe; a model or setting it cannot serve fails the command.

    The settings and the model directory are checked before torch is imported (engine_ext's
    config and model store are torch-free), so a bad option is refused in about a second,
    not after the several seconds that loading the engine's stack takes."""
    try:
        from engine_ext.errors import EngineError
        from engine_ext.model_store import resolve_model
    except ModuleNotFoundError as exc:  # a gateway-only install
        raise _engine_extra_missing(exc) from exc
    try:
        config = settings.engine_config()
        model_dir = resolve_model(settings.model)
    except (EngineError, ValueError) as exc:
        raise _fail(str(exc).replace("\n", "; ")) from exc
    try:
        from engine_ext.async_engine import build_off_thread
        from engine_ext.engine import LLMEngine
    except ModuleNotFoundError as exc:  # engine_ext without torch
        raise _engine_extra_missing(exc) from exc
    try:
        # Served, the engine is stepped on its own thread (AsyncEngine): see build_off_thread.
        return build_off_thread(lambda: LLMEngine(model_dir, config, settings.served_model_name or model_dir.name))
    except (EngineError, ValueError) as exc:
        raise _fail(str(exc).replace("\n", "; ")) from exc


class _GatewayOverrides(TypedDict, total=False):
    """The GatewaySettings fields a command's options set: a key left out keeps its value
    from the environment (KVRELAY_*) or the default."""

    upstreams: list[str]
    database_url: str


def _gateway_settings(upstreams: list[str] | None, database_url: str | None) -> GatewaySettings:
    from pydantic import ValidationError

    from kvrelay.gateway.settings import GatewaySettings

    overrides: _GatewayOverrides = {}
    if upstreams:
        overrides["upstreams"] = upstreams
    if database_url:
        overrides["database_url"] = database_url
    try:
        return GatewaySettings(**overrides)
    except ValidationError as exc:  # field and reason only: input values may be secrets
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'settings'}: {e['msg']}" for e in exc.errors())
        raise _fail(f"invalid gateway settings: {problems}") from exc
    except ValueError as exc:
        raise _fail(str(exc).replace("\n", "; ")) from exc


def _build_gateway_app(settings: GatewaySettings) -> FastAPI:
    from kvrelay.gateway import create_app
    from kvrelay.wire.otel import TracingConfigError

    try:
        return create_app(settings)
    except TracingConfigError as exc:
        raise _fail(str(exc)) from exc


def _plan_seal(host: str) -> PlanSeal | None:
    """The engine's PlanSeal from KVRELAY_PLAN_SECRET and KVRELAY_PLAN_MAX_AGE_S (the
    gateway's plan_secret and plan_max_age_s; environment variables, never arguments, so
    `ps` does not show the secret). Without one the engine follows any plan, so it may
    listen on loopback only."""
    import ipaddress

    from kvrelay.wire.seal import PlanSeal

    try:
        seal = PlanSeal.from_env()
    except ValueError as exc:
        raise _fail(str(exc)) from exc
    if seal is not None:
        return seal
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback:
        raise _fail(f"--host {host} is reachable beyond loopback: set KVRELAY_PLAN_SECRET (the gateway's "
                    "plan_secret) so the engine follows only the gateway's sealed plans")
    return None


def _build_engine_app(llm: LLMEngine, seal: PlanSeal | None, generic_tool_auto: AutoPolicy) -> FastAPI:
    from engine_ext.async_engine import AsyncEngine
    from kvrelay.wire.otel import TracingConfigError
    from engine_ext.server import create_app

    try:
        return create_app(AsyncEngine(llm), llm.model_name, plan_seal=seal, generic_tool_auto=generic_tool_auto)
    except TracingConfigError as exc:
        raise _fail(str(exc)) from exc


ModelOpt = Annotated[Optional[str], typer.Option(help="HF-format model directory (default: SmolLM2-135M-Instruct, prepared on first use)")]
HostOpt = Annotated[str, typer.Option(help="address to bind")]
LogOpt = Annotated[str, typer.Option(help="log level")]


@app.command()
@with_settings(EngineSettings, _fail)
def engine(
    settings: EngineSettings,
    host: HostOpt = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535)] = 8000,
    log_level: LogOpt = "info",
) -> None:
    """Serve one model over the OpenAI API with kvrelay's embedded engine. Every engine
    option is also KVRELAY_ENGINE_<NAME>, or a key of the YAML file KVRELAY_ENGINE_CONFIG."""
    import uvicorn

    _setup_logging(log_level)
    seal = _plan_seal(host)  # before the model loads: a refusal should be quick
    llm = _build_engine(settings)
    engine_app = _build_engine_app(llm, seal, settings.generic_tool_auto)
    typer.echo(f"kvrelay engine: serving {llm.model_name}; base_url=http://{host}:{port}/v1")
    uvicorn.run(engine_app, host=host, port=port, log_level=log_level)


@app.command()
def gateway(
    upstream: Annotated[Optional[list[str]], typer.Option(help="upstream engine base URL (repeat for several; default from KVRELAY_UPSTREAMS)")] = None,
    database_url: Annotated[Optional[str], typer.Option(help="SQLAlchemy URL (default from KVRELAY_DATABASE_URL)")] = None,
    host: HostOpt = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535)] = 8080,
    log_level: LogOpt = "info",
    workers: Annotated[int, typer.Option(min=1, max=64, help="gateway processes on this port; more than one "
                                                            "share what they infer through the database")] = 1,
) -> None:
    """Run the OpenAI gateway alone, in front of already running engines."""
    import uvicorn

    from kvrelay.gateway.collector import tune_for_serving

    _setup_logging(log_level)
    settings = _gateway_settings(upstream, database_url)
    typer.echo(f"kvrelay gateway: upstreams {', '.join(settings.upstreams)}; base_url=http://{host}:{port}/v1"
               + (f"; {workers} workers sharing inferred state" if workers > 1 else ""))
    if workers == 1:
        gateway_app = _build_gateway_app(settings)
        tune_for_serving()
        uvicorn.run(gateway_app, host=host, port=port, log_level=log_level,
                    timeout_keep_alive=settings.client_keepalive_s)
        return
    _prepare_workers(settings)
    uvicorn.run("kvrelay.gateway.app:create_served_app", factory=True, workers=workers, host=host, port=port,
                log_level=log_level, timeout_keep_alive=settings.client_keepalive_s)


def _prepare_workers(settings: GatewaySettings) -> None:
    """Gateway workers are replicas of one another: each builds its settings from the
    environment (this process's flags passed on there), with replication on, on a
    database migrated once here (several processes migrating at once would race)."""
    import json

    from kvrelay.gateway.storage import migrate

    os.environ["KVRELAY_UPSTREAMS"] = json.dumps(settings.upstreams)
    os.environ["KVRELAY_DATABASE_URL"] = settings.database_url
    os.environ["KVRELAY_REPLICATION__ENABLED"] = "true"
    os.environ.pop("KVRELAY_REPLICATION__REPLICA_ID", None)  # one id per worker, made by each
    _gateway_settings(None, None)  # what the workers will read: refused here, in one line, if invalid
    migrate.upgrade(settings.database_url)


@app.command()
@with_settings(EngineSettings, _fail)
def up(
    settings: EngineSettings,
    host: HostOpt = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="the gateway's port")] = 8000,
    engine_port: Annotated[int, typer.Option(min=1, max=65535, help="the embedded engine's port (loopback)")] = 8001,
    database_url: Annotated[Optional[str], typer.Option(help="SQLAlchemy URL (default from KVRELAY_DATABASE_URL)")] = None,
    log_level: LogOpt = "info",
) -> None:
    """Start the embedded engine and the gateway in front of it, in one process."""
    import asyncio

    import uvicorn

    from kvrelay.gateway.collector import tune_for_serving

    _setup_logging(log_level)
    # The gateway's settings first: a refusal should not wait for the model to load.
    front, seal = sealed(_gateway_settings([f"http://127.0.0.1:{engine_port}"], database_url))
    llm = _build_engine(settings)
    gateway_app = _build_gateway_app(front)
    # The engine keeps the gateway's idle connections longer than the gateway's pool does.
    engine_server = uvicorn.Server(uvicorn.Config(_build_engine_app(llm, seal, settings.generic_tool_auto),
                                                  host="127.0.0.1", port=engine_port, log_level=log_level,
                                                  timeout_keep_alive=math.ceil(front.keepalive_s) + 5))
    gateway_server = uvicorn.Server(uvicorn.Config(gateway_app, host=host, port=port, log_level=log_level,
                                                   timeout_keep_alive=front.client_keepalive_s))

    async def serve_both() -> None:
        engine_task = asyncio.create_task(engine_server.serve())
        while not engine_server.started:  # the gateway's first health check must find the engine
            if engine_task.done():
                return
            await asyncio.sleep(0.05)
        typer.echo(f"kvrelay: serving {llm.model_name}; point your OpenAI client at base_url=http://{host}:{port}/v1")
        await gateway_server.serve()
        engine_server.should_exit = True
        await engine_task

    tune_for_serving()
    asyncio.run(serve_both())


def sealed(front: GatewaySettings) -> tuple[GatewaySettings, PlanSeal]:
    """`kvrelay up`'s gateway settings with a plan secret (the one configured, else a
    fresh random one) and the engine's seal of it. The gateway and the engine are one
    process here, so they can share a secret nobody else knows, and the engine follows
    only the gateway's sealed plans: without one, any local process could send the
    engine's port a plan naming another tenant's cache and be served from it."""
    from pydantic import SecretStr

    from kvrelay.wire.seal import PlanSeal

    secret = front.plan_secret
    if secret is None:
        secret = SecretStr(secrets.token_urlsafe(32))
        front = front.model_copy(update={"plan_secret": secret})
    return front, PlanSeal(secret.get_secret_value(), front.plan_max_age_s)


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per health check is noise
    logging.getLogger("alembic.runtime.plugins").setLevel(logging.WARNING)


db_app = typer.Typer(help="Database schema (alembic).")
app.add_typer(db_app, name="db")
DbUrlOpt = Annotated[Optional[str], typer.Option(help="SQLAlchemy URL (default from KVRELAY_DATABASE_URL)")]


@db_app.command("upgrade")
def db_upgrade(revision: Annotated[str, typer.Argument()] = "head", database_url: DbUrlOpt = None) -> None:
    """Apply migrations up to REVISION (default: head)."""
    _run_migration("upgrade", revision, database_url)


@db_app.command("downgrade")
def db_downgrade(revision: Annotated[str, typer.Argument(help="target revision, e.g. -1 or base")],
                 database_url: DbUrlOpt = None) -> None:
    """Revert migrations down to REVISION."""
    _run_migration("downgrade", revision, database_url)


def _run_migration(direction: str, revision: str, database_url: str | None) -> None:
    from alembic.util import CommandError
    from sqlalchemy.exc import SQLAlchemyError

    from kvrelay.gateway.storage import migrate

    url = _gateway_settings(None, database_url).database_url
    try:
        getattr(migrate, direction)(url, revision)
    except (CommandError, SQLAlchemyError, OSError, ImportError) as exc:
        raise _fail(f"db {direction} failed: {exc}") from exc
    typer.echo(f"database at revision {revision} ({direction})")


@app.command()
def ttft(session_id: Annotated[str, typer.Argument(help="the session's id (see GET /admin/sessions)")],
         as_json: Annotated[bool, typer.Option("--json", help="print the report as JSON")] = False,
         database_url: DbUrlOpt = None) -> None:
    """Where each request's time to first token went, per request and per round, and what reuse saved
    against prefix caching alone (the report GET /admin/sessions/{id}/ttft and /ui show)."""
    import asyncio
    import json

    from alembic.util import CommandError
    from sqlalchemy.exc import SQLAlchemyError
    from kvrelay.gateway.storage import migrate
    from kvrelay.gateway.storage.engine import open_database
    from kvrelay.gateway.ttft import format_report, load_requests, session_ttft

    url = _gateway_settings(None, database_url).database_url

    async def run() -> list[Any]:
        engine = open_database(url)
        try:
            return await load_requests(engine, session_id)
        finally:
            await engine.dispose()

    try:
        migrate.upgrade(url)
        rows = asyncio.run(run())
    except (CommandError, SQLAlchemyError, OSError, ImportError) as exc:
        raise _fail(f"database {url.split('@')[-1]}: {type(exc).__name__}: {exc}".splitlines()[0]) from exc
    if not rows:
        raise _fail(f"no requests recorded for session {session_id!r}")
    report = session_ttft(session_id, rows)
    typer.echo(json.dumps(report, indent=2) if as_json else format_report(report))


keys_app = typer.Typer(help="Client API keys (stored hashed; the secret is shown once).")
app.add_typer(keys_app, name="keys")
LimitOpt = Annotated[Optional[int], typer.Option(min=1, help="per-minute limit (default: the gateway's default, if any)")]


@keys_app.command("create")
def keys_create(name: Annotated[str, typer.Argument(help="who the key is for")], rpm: LimitOpt = None,
                tpm: LimitOpt = None, database_url: DbUrlOpt = None) -> None:
    """Create a key with optional requests/min (--rpm) and tokens/min (--tpm) limits."""
    created = _with_keys(database_url, lambda store: store.create(name, rpm, tpm))
    typer.echo(f"{created.info.id}  {created.secret}")
    typer.echo("store the key now: kvrelay keeps only its hash", err=True)


@keys_app.command("list")
def keys_list(database_url: DbUrlOpt = None) -> None:
    """List keys: id, name, prefix, limits, state."""
    for key in _with_keys(database_url, lambda store: store.list()):
        state = f"revoked {key.revoked_at:%Y-%m-%d %H:%M}" if key.revoked_at else "active"
        limits = f"rpm={key.requests_per_minute or '-'} tpm={key.tokens_per_minute or '-'}"
        typer.echo(f"{key.id}  {key.prefix}...  {limits}  {state}  {key.name}")


@keys_app.command("revoke")
def keys_revoke(key_id: Annotated[str, typer.Argument(help="the key's id (see `kvrelay keys list`)")],
                database_url: DbUrlOpt = None) -> None:
    """Revoke a key; running gateways stop accepting it within key_refresh_s."""
    key = _with_keys(database_url, lambda store: store.revoke(key_id))
    typer.echo(f"{key.id} revoked")


def _with_keys(database_url: str | None, action: Callable[[KeyStore], Awaitable[T]]) -> T:
    """Run `action(KeyStore)` against the (migrated) database; one-line errors."""
    import asyncio

    from alembic.util import CommandError
    from sqlalchemy.exc import SQLAlchemyError

    from kvrelay.gateway.auth import KeyNotFoundError, KeyStore
    from kvrelay.gateway.storage import migrate
    from kvrelay.gateway.storage.engine import open_database

    url = _gateway_settings(None, database_url).database_url

    async def run() -> T:
        engine = open_database(url)
        try:
            return await action(KeyStore(engine))
        finally:
            await engine.dispose()

    try:
        migrate.upgrade(url)
        return asyncio.run(run())
    except (KeyNotFoundError, ValueError) as exc:
        raise _fail(str(exc)) from exc
    except (CommandError, SQLAlchemyError, OSError) as exc:
        raise _fail(f"database {url.split('@')[-1]}: {type(exc).__name__}: {exc}".splitlines()[0]) from exc


@app.command("prepare-model")
def prepare_model() -> None:
    """Convert the default model once (happens automatically on first `engine` start)."""
    from engine_ext.errors import EngineError
    from engine_ext.model_store import prepare_default_model

    try:
        typer.echo(prepare_default_model())
    except EngineError as exc:
        raise _fail(str(exc)) from exc


@app.command()
def train(
    mode: Annotated[str, typer.Argument(help="icarus (a logical decoder over the frozen base's KV) | lora")],
    data: Annotated[Path, typer.Option(help="JSONL: one {\"prompt\", \"completion\"} or {\"messages\"} object per line")],
    out: Annotated[Path, typer.Option(help="directory for the PEFT adapter")],
    model: ModelOpt = None,
    rank: Annotated[int, typer.Option(min=1, max=256, help="LoRA rank")] = 8,
    alpha: Annotated[float, typer.Option(min=0.0, help="LoRA alpha (scaling = alpha / rank)")] = 16.0,
    steps: Annotated[int, typer.Option(min=1, help="passes over the examples")] = 3,
    lr: Annotated[float, typer.Option(min=0.0, help="AdamW learning rate")] = 1e-3,
    max_examples: Annotated[Optional[int], typer.Option(min=1, help="use at most this many examples")] = None,
) -> None:
    """Fine-tune a LoRA adapter on CPU with the base frozen; writes it in PEFT's format,
    marked with the training mode (only icarus-trained adapters are served in icarus mode)."""
    if mode not in ("icarus", "lora"):  # refused before the training stack (torch) loads
        raise _fail(f"unknown training mode {mode!r} (icarus | lora)")
    from engine_ext.adapters.dataset import read_examples
    from engine_ext.adapters.training import train as fit
    from engine_ext.config import ModelConfig
    from engine_ext.errors import EngineError
    from engine_ext.model import load_model
    from engine_ext.model_store import resolve_model
    from engine_ext.tokenizer import Tokenizer

    try:
        model_dir = resolve_model(model)
        cfg = ModelConfig.from_dir(model_dir)
        examples = read_examples(data, Tokenizer(model_dir), max_examples)
        base = load_model(model_dir, cfg)
    except EngineError as exc:
        raise _fail(str(exc)) from exc
    factors, losses = fit(base, examples, mode, rank=rank, alpha=alpha, steps=steps, lr=lr)  # type: ignore[arg-type]
    for step, loss in enumerate(losses, start=1):
        typer.echo(f"step {step}: loss {loss:.4f}")
    try:
        factors.save(out)  # marked with `mode`: --adapter-mode auto serves icarus-trained adapters in icarus mode
    except OSError as exc:
        raise _fail(f"cannot write {out}: {exc.strerror or exc}") from exc
    served = "icarus" if mode == "icarus" else "multi_lora"
    typer.echo(f"wrote {mode} adapter to {out} (marked as {mode}-trained: --adapter-mode auto serves it as {served})")


@app.command()
def bench(
    name: Annotated[str, typer.Argument(help="benchmark to run (see `kvrelay bench --help`)")],
    quick: Annotated[bool, typer.Option("--quick", help="small sizes; finishes in under a minute")] = False,
    json_path: Annotated[Optional[Path], typer.Option("--json", help="write the result JSON here")] = None,
    model: Annotated[Optional[str], typer.Option(help="model directory (default model if omitted)")] = None,
    family: Annotated[Optional[str], typer.Option(help="workload family, for a benchmark that has several "
                                                       "(agents: short, the default, or long)")] = None,
) -> None:
    """Run a benchmark: kvrelay and its baseline side by side; prints a table, writes JSON.
    The benchmarks run from a source checkout (they are not installed with kvrelay)."""
    BENCHMARKS, run_benchmark = _benchmarks()

    if name not in BENCHMARKS:
        raise _fail(f"unknown benchmark {name!r}; available: {', '.join(sorted(BENCHMARKS))}")
    try:
        run_benchmark(name, quick=quick, json_path=json_path, model=model, family=family)
    except (OSError, ValueError) as exc:
        raise _fail(str(exc)) from exc


def _benchmarks() -> tuple[Mapping[str, str], Callable[..., Any]]:
    """The source checkout's `benchmarks` package: the one beside this kvrelay package (an
    editable install) or, else, one importable from here; a regular install has none."""
    checkout = Path(__file__).resolve().parents[1]
    is_checkout = (checkout / "pyproject.toml").is_file() and (checkout / "benchmarks" / "__init__.py").is_file()
    if is_checkout and str(checkout) not in sys.path:
        sys.path.append(str(checkout))
    try:
        from benchmarks import BENCHMARKS, run_benchmark
    except ImportError as exc:  # no such package, or another distribution's `benchmarks`
        if exc.name != "benchmarks":
            raise
        raise _fail("the benchmarks run from kvrelay's source checkout (they are not installed with the "
                    "package): run `kvrelay bench` from an editable install (`make install`)") from exc
    return BENCHMARKS, run_benchmark


def main() -> None:
    """Console entry point: usage errors become one line on stderr, exit code 2."""
    if len(sys.argv) == 1:
        sys.argv.append("--help")
    try:
        result = app(standalone_mode=False)
    except typer.Abort:
        raise SystemExit(130) from None
    except typer.TyperException as exc:
        message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
        typer.echo(f"kvrelay: error: {message}", err=True)
        raise SystemExit(getattr(exc, "exit_code", 2)) from None
    # With standalone_mode=False, typer returns a command's exit code instead of exiting.
    raise SystemExit(result if isinstance(result, int) else 0)
