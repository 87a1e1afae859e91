"""Settings whose last source is one YAML file named by an environment variable.

The gateway (KVRELAY_CONFIG) and the engine (KVRELAY_ENGINE_CONFIG) read their files
the same way: lowest priority, after arguments and the environment, so a flag or a
variable always wins over the file.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, ClassVar

import yaml
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource


class YamlFileSource(PydanticBaseSettingsSource):
    def __init__(self, settings_cls: type[BaseSettings], variable: str) -> None:
        super().__init__(settings_cls)
        self.variable = variable

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # the whole mapping comes from __call__

    def __call__(self) -> dict[str, Any]:
        path = os.environ.get(self.variable)
        if not path:
            return {}
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ValueError(f"cannot read {self.variable}={path}: {exc}") from exc
        if not isinstance(data, dict):
            raise ValueError(f"{self.variable}={path} must hold a mapping")
        return data


class YamlFileSettings(BaseSettings):
    """BaseSettings read from arguments, then the environment, then the YAML file named
    by the variable `yaml_variable`."""

    yaml_variable: ClassVar[str]

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, env_settings, YamlFileSource(settings_cls, cls.yaml_variable)
