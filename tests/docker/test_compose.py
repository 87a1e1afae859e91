"""Static checks of the deployment files in docker/: no Docker engine needed.

The compose file is validated against the compose specification's JSON schema (vendored
by the check-jsonschema dev dependency); the paths it and the Dockerfiles name must exist;
the collector pipeline, the gateway's OTEL endpoint and its KVRELAY_* settings must agree.
"""

from __future__ import annotations

import copy
import json
import os
import re
from functools import cache
from importlib.resources import files
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from kvrelay.gateway.settings import GatewaySettings

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "docker"
_DEFAULT = re.compile(r"^\$\{(\w+):?-([^}]*)\}$")  # ${VAR:-default} / ${VAR-default}


@cache
def _yaml(name: str) -> dict[str, Any]:
    return yaml.safe_load((DOCKER / name).read_text())


def _compose() -> dict[str, Any]:
    return copy.deepcopy(_yaml("docker-compose.yml"))


def _schema_errors(document: dict[str, Any]) -> list[str]:
    schema = json.loads(files("check_jsonschema.builtin_schemas.vendor").joinpath("compose-spec.json").read_text())
    validator = jsonschema.validators.validator_for(schema)(schema)
    return [f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in validator.iter_errors(document)]


def _services() -> dict[str, dict[str, Any]]:
    return _compose()["services"]


def _environment(service: dict[str, Any]) -> dict[str, Any]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, None) for item in env)
    return env


def test_compose_file_matches_the_compose_spec() -> None:
    errors = _schema_errors(_compose())
    assert not errors, "docker-compose.yml violates the compose spec:\n" + "\n".join(errors)


@pytest.mark.parametrize("mutate", [
    lambda d: d["services"]["gateway"].__setitem__("ports", "not-a-list"),
    lambda d: d.__setitem__("servicez", {}),
], ids=["ports-not-a-list", "unknown-top-level-key"])
def test_schema_validation_can_fail(mutate) -> None:
    document = _compose()
    mutate(document)
    assert _schema_errors(document)


def test_build_contexts_dockerfiles_and_bind_mounts_exist() -> None:
    for name, service in _services().items():
        if build := service.get("build"):
            context = (DOCKER / (build if isinstance(build, str) else build.get("context", "."))).resolve()
            assert context.is_dir(), f"{name}: build context {context} missing"
            dockerfile = "Dockerfile" if isinstance(build, str) else build.get("dockerfile", "Dockerfile")
            assert (context / dockerfile).is_file(), f"{name}: {dockerfile} not found in {context}"
        for volume in service.get("volumes", []):
            source = volume.split(":", 1)[0] if isinstance(volume, str) else volume.get("source", "")
            if source.startswith(("./", "../")):
                assert (DOCKER / source).exists(), f"{name}: bind mount {source} missing"


def _copy_sources(dockerfile: Path) -> list[str]:
    sources = []
    for line in dockerfile.read_text().splitlines():
        words = line.split()
        if words and words[0].upper() == "COPY":
            args = [w for w in words[1:] if not w.startswith("--")]
            sources += args[:-1]
    return sources


@pytest.mark.parametrize("dockerfile", sorted(DOCKER.glob("Dockerfile*")), ids=lambda p: p.name)
def test_dockerfile_copy_sources_exist(dockerfile: Path) -> None:
    sources = _copy_sources(dockerfile)
    assert sources, f"{dockerfile.name} copies nothing"
    missing = [s for s in sources if not (REPO / s).exists()]
    assert not missing, f"{dockerfile.name} COPYs paths missing from the repo root: {missing}"


def test_collector_pipeline_and_gateway_endpoint_agree() -> None:
    collector = _yaml("otel-collector.yaml")
    traces = collector["service"]["pipelines"]["traces"]
    for section in ("receivers", "processors", "exporters"):
        undefined = set(traces[section]) - set(collector.get(section) or {})
        assert not undefined, f"traces pipeline names undefined {section}: {undefined}"
    http_port = collector["receivers"]["otlp"]["protocols"]["http"]["endpoint"].rsplit(":", 1)[1]
    for name in ("gateway", "engine"):  # both services' spans reach Jaeger, joined by traceparent
        service = _services()[name]
        env = _environment(service)
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == f"http://otel-collector:{http_port}" and http_port == "4318"
        assert env["OTEL_SERVICE_NAME"] == f"kvrelay-{name}" and "otel-collector" in service["depends_on"]
    hosts = {exp["endpoint"].split(":")[0] for exp in collector["exporters"].values() if "endpoint" in (exp or {})}
    assert "jaeger" in hosts and "jaeger" in _services()


def test_gateway_environment_names_real_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    env = _environment(_services()["gateway"])
    keys = [k for k in env if k.startswith("KVRELAY_") and k != "KVRELAY_CONFIG"]
    assert keys
    unknown = [k for k in keys if k[8:].lower().split("__")[0] not in GatewaySettings.model_fields]  # nested: A__B
    assert not unknown, f"gateway environment names no such setting: {unknown}"
    # What the container sees with nothing set in the shell must make valid settings.
    for key in [k for k in os.environ if k.startswith("KVRELAY_")]:
        monkeypatch.delenv(key)
    for key in keys:
        value = env[key]
        if value is None:  # no value: unset in the container when the shell lacks it
            continue
        match = _DEFAULT.match(str(value))
        monkeypatch.setenv(key, match.group(2) if match else str(value))
    settings = GatewaySettings()
    assert settings.upstreams == ["http://engine:8000"]


def test_only_vllm_is_behind_the_gpu_profile() -> None:
    profiled = {name: s["profiles"] for name, s in _services().items() if "profiles" in s}
    assert profiled == {"vllm": ["gpu"]}


def test_the_vllm_service_runs_the_kvrelay_connector_as_the_suite_does() -> None:
    from engine_ext.vllm.config import ConnectorConfig
    from engine_ext.vllm.server import connector_transfer_config

    command = _services()["vllm"]["command"]
    config = json.loads(command[command.index("--kv-transfer-config") + 1])
    extra = config["kv_connector_extra_config"]
    assert config == connector_transfer_config(extra)
    ConnectorConfig.from_extra(extra, "compose")  # valid settings
    assert extra["host_dir"].startswith("/dev/shm/")
    mounts = [v.split(":")[1] for v in _services()["vllm"]["volumes"]]
    assert extra["disk_dir"] in mounts


def test_gateway_and_engine_share_the_plan_secret_and_compose_requires_it() -> None:
    services = _services()
    secrets = {name: _environment(services[name])["KVRELAY_PLAN_SECRET"] for name in ("gateway", "engine")}
    assert secrets["gateway"] == secrets["engine"] and secrets["gateway"].startswith("${KVRELAY_PLAN_SECRET:?")


def test_the_proxy_spreads_requests_over_replicas_that_share_their_state() -> None:
    services = _services()
    replicas = {name: s for name, s in services.items() if s.get("build", {}).get("dockerfile") == "docker/Dockerfile.gateway"}
    assert len(replicas) >= 2
    envs = [_environment(s) for s in replicas.values()]
    assert all(env["KVRELAY_REPLICATION__ENABLED"] == "true" and env["KVRELAY_RECORD_JOURNAL_DIR"] for env in envs)
    assert len({env["KVRELAY_DATABASE_URL"] for env in envs}) == 1  # one shared database
    assert {env["KVRELAY_DATABASE_URL"].split("://")[0] for env in envs} == {"postgresql+asyncpg"}
    proxy = services["proxy"]
    assert proxy["ports"] == ["8080:8080"] and not any("ports" in s for s in replicas.values())
    mount = next(v for v in proxy["volumes"] if v.endswith("/etc/nginx/nginx.conf:ro"))
    conf = (DOCKER / mount.split(":")[0]).read_text()
    assert sorted(re.findall(r"^\s*server (\S+):8080", conf, re.M)) == sorted(replicas)
    assert "proxy_buffering off" in conf  # streamed answers pass as they come
    assert GatewaySettings(database_url="postgresql+asyncpg://u@h/d", replication={"enabled": True}).replication.enabled
