"""GatewaySettings: defaults, KVRELAY_* environment variables, the YAML file named by
KVRELAY_CONFIG (below the environment), validation."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvrelay.gateway.settings import GatewaySettings


def test_defaults(clean_env):
    s = GatewaySettings()
    assert s.upstreams == ["http://127.0.0.1:8000"]
    assert s.store_content is False
    assert (s.timeouts.connect_s, s.timeouts.first_byte_s, s.timeouts.idle_s, s.timeouts.total_s) == (5, 60, 60, 600)
    assert (s.breaker.failure_threshold, s.breaker.cooldown_s) == (3, 10)
    assert s.retries == 2 and s.load_guard_factor == 2.0


def test_environment_variables(clean_env):
    clean_env.setenv("KVRELAY_UPSTREAMS", '["http://10.0.0.1:8000/", "https://engine.example"]')
    clean_env.setenv("KVRELAY_TIMEOUTS__IDLE_S", "7.5")
    clean_env.setenv("KVRELAY_BREAKER__COOLDOWN_S", "2")
    clean_env.setenv("KVRELAY_STORE_CONTENT", "true")
    clean_env.setenv("KVRELAY_DATABASE_URL", "sqlite+aiosqlite:////tmp/x.db")
    s = GatewaySettings()
    assert s.upstreams == ["http://10.0.0.1:8000", "https://engine.example"]  # trailing slash dropped
    assert s.timeouts.idle_s == 7.5
    assert s.timeouts.first_byte_s == 60  # the other nested fields keep their defaults
    assert s.breaker.cooldown_s == 2 and s.breaker.failure_threshold == 3
    assert s.store_content is True
    assert s.database_url == "sqlite+aiosqlite:////tmp/x.db"


def test_yaml_file_below_the_environment(clean_env, tmp_path):
    config = tmp_path / "gateway.yaml"
    config.write_text(
        "upstreams:\n  - http://yaml-a:8000\n  - http://yaml-b:8000\n"
        "timeouts:\n  idle_s: 3\n  first_byte_s: 4\n"
        "breaker:\n  failure_threshold: 5\n"
        "retries: 1\n"
        "health_interval_s: 0.5\n"
    )
    clean_env.setenv("KVRELAY_CONFIG", str(config))
    s = GatewaySettings()
    assert s.upstreams == ["http://yaml-a:8000", "http://yaml-b:8000"]
    assert (s.timeouts.idle_s, s.timeouts.first_byte_s, s.breaker.failure_threshold) == (3, 4, 5)
    assert (s.retries, s.health_interval_s) == (1, 0.5)

    clean_env.setenv("KVRELAY_TIMEOUTS__IDLE_S", "9")
    clean_env.setenv("KVRELAY_RETRIES", "0")
    clean_env.setenv("KVRELAY_UPSTREAMS", '["http://env:1"]')
    s = GatewaySettings()
    assert s.timeouts.idle_s == 9  # the environment wins
    assert s.timeouts.first_byte_s == 4  # the YAML's other nested values stay
    assert s.retries == 0
    assert s.upstreams == ["http://env:1"]
    assert s.breaker.failure_threshold == 5
    # explicit arguments win over both
    assert GatewaySettings(retries=3).retries == 3


@pytest.mark.parametrize("urls", [["127.0.0.1:8000"], ["ftp://host"], ["http://ok", "localhost"], []])
def test_invalid_upstreams(clean_env, urls):
    with pytest.raises(ValidationError) as info:
        GatewaySettings(upstreams=urls)
    assert "upstreams" in str(info.value)


def test_invalid_upstream_from_the_environment(clean_env):
    clean_env.setenv("KVRELAY_UPSTREAMS", '["engine:8000"]')
    with pytest.raises(ValidationError, match="http"):
        GatewaySettings()


@pytest.mark.parametrize("name,value", [
    ("KVRELAY_TIMEOUTS__IDLE_S", "0"), ("KVRELAY_RETRIES", "6"), ("KVRELAY_MAX_BODY_BYTES", "10"),
    ("KVRELAY_BREAKER__FAILURE_THRESHOLD", "0"), ("KVRELAY_LOAD_GUARD_FACTOR", "0.5"),
])
def test_out_of_range_values(clean_env, name, value):
    clean_env.setenv(name, value)
    with pytest.raises(ValidationError):
        GatewaySettings()


def test_bad_yaml_files(clean_env, tmp_path):
    clean_env.setenv("KVRELAY_CONFIG", str(tmp_path / "missing.yaml"))
    with pytest.raises(ValueError, match="missing.yaml"):
        GatewaySettings()
    listing = tmp_path / "list.yaml"
    listing.write_text("- a\n- b\n")
    clean_env.setenv("KVRELAY_CONFIG", str(listing))
    with pytest.raises(ValueError, match="mapping"):
        GatewaySettings()
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("upstreamz: [http://x]\n")
    clean_env.setenv("KVRELAY_CONFIG", str(unknown))
    with pytest.raises(ValidationError, match="upstreamz"):
        GatewaySettings()
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    clean_env.setenv("KVRELAY_CONFIG", str(empty))
    assert GatewaySettings().upstreams == ["http://127.0.0.1:8000"]


def test_an_empty_variable_means_unset(clean_env):
    clean_env.setenv("KVRELAY_ADMIN_KEY", "")
    clean_env.setenv("KVRELAY_UPSTREAM_API_KEY", "")
    settings = GatewaySettings()
    assert settings.admin_key is None and settings.upstream_api_key is None


def test_secrets_are_hidden_in_the_settings_repr(clean_env):
    clean_env.setenv("KVRELAY_ADMIN_KEY", "a-long-admin-secret-value")
    assert "a-long-admin-secret-value" not in repr(GatewaySettings())
