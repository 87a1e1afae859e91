"""Every engine option reaches the engine, from each of its three sources, and its
bound is one bound: the settings refuse exactly what the engine's config refuses."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import annotated_types
import pytest
import typer
from pydantic import ValidationError
from typer.testing import CliRunner

from engine_ext.config import AnchorConfig, CollectiveConfig, EngineConfig, ReuseConfig, TierConfig
from kvrelay import cli
from kvrelay.engine_settings import EngineSettings

MiB = 2**20
Reached = Callable[[EngineSettings, EngineConfig], Any]


@dataclass(frozen=True)
class Option:
    """A non-default value of one option, where it lands, and what it must be there."""

    value: Any  # as YAML would hold it
    reached: Reached
    expected: Any
    companions: dict[str, Any] = field(default_factory=dict)  # options it needs alongside
    config: tuple[type, str] | None = None  # the config field of the same unit, for the bound check


ADAPTER = {"adapter": ["a=/tmp/a"]}
OPTIONS: dict[str, Option] = {
    "model": Option("/tmp/model", lambda s, c: s.model, "/tmp/model"),
    "served_model_name": Option("m", lambda s, c: s.served_model_name, "m"),
    "kv_cache_mb": Option(64, lambda s, c: c.kv_cache_bytes, 64 * MiB),
    "block_size": Option(32, lambda s, c: c.block_size, 32, config=(EngineConfig, "block_size")),
    "max_num_seqs": Option(8, lambda s, c: c.max_num_seqs, 8, config=(EngineConfig, "max_num_seqs")),
    "max_num_batched_tokens": Option(512, lambda s, c: c.max_num_batched_tokens, 512,
                                     config=(EngineConfig, "max_num_batched_tokens")),
    "probe_chunk_tokens": Option(32, lambda s, c: c.probe_chunk_tokens, 32,
                                 config=(EngineConfig, "probe_chunk_tokens")),
    "probe_idle_ms": Option(100.5, lambda s, c: c.probe_idle_ms, 100.5, config=(EngineConfig, "probe_idle_ms")),
    "max_model_len": Option(1024, lambda s, c: c.max_model_len, 1024, config=(EngineConfig, "max_model_len")),
    "dtype": Option("bfloat16", lambda s, c: c.dtype, "bfloat16", config=(EngineConfig, "dtype")),
    "linear_kernel": Option("plain", lambda s, c: c.linear_kernel, "plain", config=(EngineConfig, "linear_kernel")),
    "reuse_method": Option("blend", lambda s, c: c.reuse.default_method, "blend"),
    "blend_ratio": Option(0.3, lambda s, c: c.reuse.blend_ratio, 0.3, config=(ReuseConfig, "blend_ratio")),
    "check_layers": Option("0,2", lambda s, c: c.reuse.check_layers, (0, 2)),
    "link_tokens": Option(4, lambda s, c: c.reuse.link_tokens, 4, config=(ReuseConfig, "link_tokens")),
    "anchor_gamma": Option(0.5, lambda s, c: c.reuse.anchors.gamma, 0.5, config=(AnchorConfig, "gamma")),
    "anchor_pool_size": Option(10, lambda s, c: c.reuse.anchors.max_anchors, 10,
                               config=(AnchorConfig, "max_anchors")),
    "anchor_prune_window": Option(3, lambda s, c: c.reuse.anchors.prune_window, 3,
                                  config=(AnchorConfig, "prune_window")),
    "anchor_temperature": Option(2.5, lambda s, c: c.reuse.anchors.temperature, 2.5,
                                 config=(AnchorConfig, "temperature")),
    "kvcomm_correction": Option("rotation", lambda s, c: c.reuse.anchors.correction, "rotation",
                                config=(AnchorConfig, "correction")),
    "kvcomm_new_samples": Option("predict", lambda s, c: c.reuse.anchors.new_samples, "predict",
                                 config=(AnchorConfig, "new_samples")),
    "anchor_chunk_tokens": Option(8, lambda s, c: c.reuse.anchors.chunk_tokens, 8,
                                  config=(AnchorConfig, "chunk_tokens")),
    "kvcomm_recompute_ratio": Option(0.1, lambda s, c: c.reuse.anchors.recompute_ratio, 0.1,
                                     config=(AnchorConfig, "recompute_ratio")),
    "collective": Option(False, lambda s, c: c.reuse.collective.enabled, False),
    "round_window_ms": Option(50.0, lambda s, c: c.reuse.collective.window_ms, 50.0,
                              config=(CollectiveConfig, "window_ms")),
    "diff_store": Option(False, lambda s, c: c.reuse.collective.diff_store, False),
    "kv_policy": Option("lru", lambda s, c: c.tiers.policy, "lru", config=(TierConfig, "policy")),
    "host_kv_mb": Option(16, lambda s, c: c.tiers.host_bytes, 16 * MiB),
    "disk_kv_dir": Option("/tmp/kvdisk", lambda s, c: c.tiers.disk_path, "/tmp/kvdisk", {"disk_kv_mb": 8}),
    "disk_kv_mb": Option(8, lambda s, c: c.tiers.disk_bytes, 8 * MiB, {"disk_kv_dir": "/tmp/kvdisk"}),
    "load_ahead": Option(3, lambda s, c: c.tiers.load_ahead, 3, config=(TierConfig, "load_ahead")),
    "adapter": Option(["a=/tmp/a"], lambda s, c: [(a.name, a.path) for a in c.adapters], [("a", "/tmp/a")]),
    "adapter_mode": Option("multi_lora", lambda s, c: c.adapters[0].mode, "multi_lora", ADAPTER),
    "adapter_first_token": Option("base", lambda s, c: c.adapters[0].first_token, "base", ADAPTER),
    "generic_tool_auto": Option("model", lambda s, c: s.generic_tool_auto, "model"),
}


def _flag_args(name: str, value: Any) -> list[str]:
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return [flag if value else "--no-" + name.replace("_", "-")]
    if isinstance(value, list):
        return [arg for item in value for arg in (flag, str(item))]
    return [flag, str(value)]


def _env_value(value: Any) -> str:
    return json.dumps(value) if isinstance(value, list) else str(value).lower() if isinstance(value, bool) \
        else str(value)


def _settings_from_flags(command: str, values: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> EngineSettings:
    """The settings `kvrelay COMMAND --flags...` builds, caught before any model loads."""
    built: list[EngineSettings] = []

    def capture(settings: EngineSettings) -> None:
        built.append(settings)
        raise typer.Exit(0)

    monkeypatch.setattr(cli, "_build_engine", capture)
    args = [command] + [arg for name, value in values.items() for arg in _flag_args(name, value)]
    result = CliRunner().invoke(cli.app, args)
    assert result.exit_code == 0 and built, result.output
    return built[0]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("KVRELAY_ENGINE_") or name.startswith("KVRELAY_PLAN_"):
            monkeypatch.delenv(name)


def test_the_table_names_every_option_once() -> None:
    """A new option without a row here fails, so none is left untested."""
    assert set(OPTIONS) == set(EngineSettings.model_fields)


@pytest.mark.parametrize("name", sorted(OPTIONS))
@pytest.mark.parametrize("source", ["flag:engine", "flag:up", "environment", "yaml"])
def test_each_option_reaches_the_engine_from_each_source(
        name: str, source: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    option = OPTIONS[name]
    values = {name: option.value, **option.companions}
    assert _default(option) != option.expected, "the row tests a default"
    if source.startswith("flag:"):
        settings = _settings_from_flags(source.removeprefix("flag:"), values, monkeypatch)
    elif source == "environment":
        for key, value in values.items():
            monkeypatch.setenv(f"KVRELAY_ENGINE_{key.upper()}", _env_value(value))
        settings = EngineSettings()
    else:
        import yaml

        path = tmp_path / "engine.yaml"
        path.write_text(yaml.safe_dump(values))
        monkeypatch.setenv("KVRELAY_ENGINE_CONFIG", str(path))
        settings = EngineSettings()
    assert option.reached(settings, settings.engine_config()) == option.expected


def _default(option: Option) -> Any:
    """What the option's landing place holds when only its companions are set (or, for a
    pair that is invalid half set, like a disk tier's directory and size, nothing)."""
    try:
        settings = EngineSettings(**option.companions)
        return option.reached(settings, settings.engine_config())
    except ValueError:
        settings = EngineSettings()
        return option.reached(settings, settings.engine_config())


def _outside(metadata: list[Any]) -> list[float]:
    """Values just past each of a field's bounds."""
    values: list[float] = []
    for bound in metadata:
        if isinstance(bound, annotated_types.Ge):
            values.append(bound.ge - (1 if isinstance(bound.ge, int) else 1e-6))
        elif isinstance(bound, annotated_types.Gt):
            values.append(bound.gt)
        elif isinstance(bound, annotated_types.Le):
            values.append(bound.le + (1 if isinstance(bound.le, int) else 1e-6))
        elif isinstance(bound, annotated_types.Lt):
            values.append(bound.lt)
    return values


@pytest.mark.parametrize("name", sorted(n for n, o in OPTIONS.items() if o.config is not None))
def test_the_settings_and_the_config_refuse_the_same_values(name: str) -> None:
    """Past each bound, both refuse; at a bound, both accept; a value outside a field's
    choices, both refuse. (One declaration: a bound written twice could drift apart.)"""
    config_cls, config_field = OPTIONS[name].config  # type: ignore[misc]
    setting, config = EngineSettings.model_fields[name], config_cls.__pydantic_fields__[config_field]
    outside = sorted(set(_outside(setting.metadata) + _outside(config.metadata)))
    choices = getattr(setting.annotation, "__args__", ())
    assert outside or choices, f"{name} has neither a bound nor choices"
    for value in outside + ([f"not-{choices[0]}"] if choices and isinstance(choices[0], str) else []):
        with pytest.raises(ValidationError):
            EngineSettings(**{name: value})
        with pytest.raises(ValidationError):
            config_cls(**{config_field: value})


@pytest.mark.parametrize("source", ["flag:engine", "flag:up", "environment"])
def test_the_int4_kernel_reaches_the_engine(source: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The row above tests "plain"; int4, the quantized decode path, is a choice of its own."""
    if source.startswith("flag:"):
        settings = _settings_from_flags(source.removeprefix("flag:"), {"linear_kernel": "int4"}, monkeypatch)
    else:
        monkeypatch.setenv("KVRELAY_ENGINE_LINEAR_KERNEL", "int4")
        settings = EngineSettings()
    assert settings.engine_config().linear_kernel == "int4"


def test_int4_with_a_non_fp32_dtype_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """The settings accept each value alone; the pair is refused by the engine's config, and
    the CLI says so in one line (exit 2) before it looks for a model."""
    settings = EngineSettings(linear_kernel="int4", dtype="bfloat16")
    with pytest.raises(ValueError, match="needs dtype float32") as caught:
        settings.engine_config()
    assert "\n" not in str(caught.value)

    def no_model(name: Any) -> Any:
        raise AssertionError("the command went on to load a model")

    monkeypatch.setattr("engine_ext.model_store.resolve_model", no_model)
    result = CliRunner().invoke(cli.app, ["engine", "--linear-kernel", "int4", "--dtype", "bfloat16"])
    assert result.exit_code == 2 and "needs dtype float32" in result.output, result.output
