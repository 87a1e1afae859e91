"""Rule files: the YAML files of adapter routing and approximation rules, read once at
startup. A missing or invalid file is a ValueError naming the file and the problem, so
the gateway refuses to start rather than run without the rules its operator wrote."""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

RuleFile = TypeVar("RuleFile", bound=BaseModel)


def load_rule_file(path: Path, model: type[RuleFile], what: str) -> RuleFile:
    """`path` parsed as `model` (a mapping with `rules`); `what` names the file in errors."""
    try:
        data: Any = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"cannot read the {what} file {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"the {what} file {path} must hold a mapping with `rules`")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise ValueError(f"invalid {what} file {path}: {problems}") from exc
