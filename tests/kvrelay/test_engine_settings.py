"""The engine's settings: one list, read from flags, the environment and a YAML file."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import typer
from pydantic import ValidationError

from kvrelay import cli
from kvrelay.cli_flags import describe, settings_parameters
from kvrelay.engine_settings import EngineSettings


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("KVRELAY_ENGINE_"):
            monkeypatch.delenv(name)


def test_defaults_make_the_exact_engine_config() -> None:
    config = EngineSettings().engine_config()
    assert config.reuse.default_method == "prefix" and config.reuse.enabled
    assert config.kv_cache_bytes == 2048 * 2**20 and config.tiers.policy == "workflow"


def test_a_variable_sets_an_option_and_a_flag_beats_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVRELAY_ENGINE_BLEND_RATIO", "0.4")
    monkeypatch.setenv("KVRELAY_ENGINE_COLLECTIVE", "false")
    assert EngineSettings().blend_ratio == 0.4 and EngineSettings().collective is False
    assert EngineSettings(blend_ratio=0.2).blend_ratio == 0.2


def test_kvcomm_s_repair_ratio_reaches_the_anchor_config(monkeypatch: pytest.MonkeyPatch) -> None:
    assert EngineSettings().engine_config().reuse.anchors.recompute_ratio == 0.0  # the paper's method
    monkeypatch.setenv("KVRELAY_ENGINE_KVCOMM_RECOMPUTE_RATIO", "0.05")
    assert EngineSettings().engine_config().reuse.anchors.recompute_ratio == 0.05


def test_the_yaml_file_sets_the_rest_below_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = tmp_path / "engine.yaml"
    path.write_text("kv_cache_mb: 64\nreuse_method: blend\nadapter: [a=/tmp/a]\n")
    monkeypatch.setenv("KVRELAY_ENGINE_CONFIG", str(path))
    monkeypatch.setenv("KVRELAY_ENGINE_KV_CACHE_MB", "128")
    settings = EngineSettings()
    assert (settings.kv_cache_mb, settings.reuse_method, settings.adapter) == (128, "blend", ["a=/tmp/a"])


def test_an_unknown_key_in_the_yaml_file_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = tmp_path / "engine.yaml"
    path.write_text("blend_ration: 0.3\n")
    monkeypatch.setenv("KVRELAY_ENGINE_CONFIG", str(path))
    with pytest.raises(ValidationError) as caught:
        EngineSettings()
    assert describe(caught.value).startswith("--blend-ration:")


@pytest.mark.parametrize(("values", "flag"), [
    ({"blend_ratio": 1.5}, "--blend-ratio"), ({"block_size": 0}, "--block-size"),
    ({"reuse_method": "magic"}, "--reuse-method"), ({"check_layers": "1,x"}, "--check-layers"),
    ({"round_window_ms": 20_000}, "--round-window-ms"), ({"load_ahead": 65}, "--load-ahead"),
    ({"adapter": ["no-path"]}, "--adapter"), ({"anchor_temperature": 0.0}, "--anchor-temperature"),
    ({"kvcomm_recompute_ratio": 1.0}, "--kvcomm-recompute-ratio"),
])
def test_a_bad_value_names_its_flag_and_variable(values: dict[str, object], flag: str) -> None:
    with pytest.raises(ValidationError) as caught:
        EngineSettings(**values)  # type: ignore[arg-type]
    name = flag.removeprefix("--").replace("-", "_").upper()
    assert describe(caught.value, "KVRELAY_ENGINE_").startswith(f"{flag} (KVRELAY_ENGINE_{name}):")


def test_engine_and_up_take_every_setting_as_a_flag() -> None:
    """The flags are generated from the settings, once: both commands list them all."""
    fields = set(EngineSettings.model_fields)
    generated = {p.name for p in settings_parameters(EngineSettings)}
    assert generated == fields
    for command in (cli.engine, cli.up):
        assert fields <= set(inspect.signature(command).parameters)


def test_flags_carry_each_field_s_description() -> None:
    by_name = {p.name: p for p in settings_parameters(EngineSettings)}
    option = by_name["kv_policy"].annotation.__metadata__[0]
    assert isinstance(option, typer.models.OptionInfo)
    assert "KVFlow" in option.help and "default: workflow" in option.help


def test_the_engine_docs_list_every_option() -> None:
    text = (Path(__file__).resolve().parents[2] / "docs" / "engine.md").read_text()
    missing = [name for name in EngineSettings.model_fields if f"`--{name.replace('_', '-')}" not in text]
    assert not missing, f"docs/engine.md lacks {missing}"
