"""Command-line flags generated from a settings class, so each option is written once.

`with_settings(Settings)` turns a command `f(settings: Settings, **own)` into a typer
command whose flags are `f`'s own parameters plus one `--field-name` per settings
field, with the field's description as its help. A flag left out is not passed on, so
the settings' other sources (environment, YAML file) and defaults still apply; the
settings are built and validated once, and a bad value is one line naming its flag.
Bounds and choices live in the settings' fields alone: typer parses types only.
"""

from __future__ import annotations

import functools
import inspect
import types
import typing
from collections.abc import Callable
from typing import Annotated, Any, Literal, Optional, TypeVar, get_args, get_origin

import typer
from pydantic import ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings

S = TypeVar("S", bound=BaseSettings)


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _option_type(annotation: Any) -> Any:
    """The type typer parses a field's flag as: its scalar type, optional; a list for a
    list field; a Literal's choices are checked by the settings, so it parses as str."""
    args = [a for a in get_args(annotation) if a is not type(None)]
    if get_origin(annotation) is Literal:
        return Optional[str]
    if get_origin(annotation) is list:
        return Optional[list[str]]
    if args and get_origin(annotation) in (typing.Union, types.UnionType):
        return _option_type(args[0])
    return Optional[annotation]


def _help(field: FieldInfo) -> str:
    text = field.description or ""
    choices = _choices(field.annotation)
    if choices and "|" not in text:
        text = f"{text} ({' | '.join(choices)})" if text else " | ".join(choices)
    default = field.get_default(call_default_factory=True)
    if default not in (None, [], ()):
        text += f"; default: {str(default).lower() if isinstance(default, bool) else default}"
    return text


def _choices(annotation: Any) -> tuple[str, ...]:
    if get_origin(annotation) is Literal:
        return tuple(str(a) for a in get_args(annotation))
    for arg in get_args(annotation):
        if (found := _choices(arg)):
            return found
    return ()


def settings_parameters(settings_cls: type[BaseSettings]) -> list[inspect.Parameter]:
    """One keyword parameter per settings field, each a typer option defaulting to None."""
    params = []
    for name, field in settings_cls.model_fields.items():
        option = typer.Option(help=_help(field), show_default=False)  # named --field-name (--x/--no-x for a bool)
        annotation = Annotated[_option_type(field.annotation), option]  # type: ignore[valid-type]
        params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=annotation))
    return params


def describe(error: ValidationError, env_prefix: str = "") -> str:
    """A validation error as one line naming each flag and its variable, e.g.
    `--blend-ratio (KVRELAY_ENGINE_BLEND_RATIO): Input should be less than or equal to 1`."""
    def where(loc: tuple[int | str, ...]) -> str:
        if not loc:
            return "settings"
        name = str(loc[0])
        return f"{flag(name)} ({env_prefix}{name.upper()})" if env_prefix else flag(name)

    return "; ".join(f"{where(e['loc'])}: {e['msg']}" for e in error.errors())


def with_settings(settings_cls: type[S], fail: Callable[[str], Exception]
                  ) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Decorate a command taking `settings: settings_cls`; `fail(message)` is the
    exception a bad value raises (the CLI's one-line exit)."""
    names = set(settings_cls.model_fields)

    def decorate(command: Callable[..., None]) -> Callable[..., None]:
        hints = typing.get_type_hints(command, include_extras=True)
        own = [p.replace(annotation=hints[p.name]) for p in inspect.signature(command).parameters.values()
               if p.name != "settings"]

        @functools.wraps(command)
        def run(**kwargs: Any) -> None:
            given = {k: v for k, v in kwargs.items() if k in names and v is not None}
            try:
                settings = settings_cls(**given)
            except ValidationError as exc:
                raise fail(describe(exc, str(settings_cls.model_config.get("env_prefix") or ""))) from exc
            except ValueError as exc:  # the YAML file cannot be read
                raise fail(str(exc)) from exc
            command(settings=settings, **{k: v for k, v in kwargs.items() if k not in names})

        parameters = own + settings_parameters(settings_cls)
        run.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
        run.__annotations__ = {p.name: p.annotation for p in parameters}
        return run

    return decorate
