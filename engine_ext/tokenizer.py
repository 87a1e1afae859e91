"""Tokenizer (HF `tokenizers`) and chat template (jinja2, rendered as HF apply_chat_template does)."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import meta
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from engine_ext.errors import InvalidRequestError, ModelLoadError


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json stores special tokens either as strings or as AddedToken dicts
    # (parsed JSON, taken as the file gives it).
    text: str | None = value.get("content") if isinstance(value, dict) else value
    return text


class ChatTemplate:
    """A compiled chat template with the globals and filters HF templates rely on."""

    def __init__(self, source: str, special_tokens: dict[str, str | None]) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
            # A template with a tools branch reads the `tools` variable; one without
            # (SmolLM2's) would drop them silently (engine_ext/tools: the generic format).
            self.takes_tools = "tools" in meta.find_undeclared_variables(env.parse(source))
        except jinja2.TemplateSyntaxError as exc:
            raise ModelLoadError(f"chat template does not compile: {exc}") from exc
        self.source = source
        self._special = special_tokens

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        try:
            return self._template.render(
                messages=messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                **self._special,
                **kwargs,
            )
        except jinja2.TemplateError as exc:
            raise InvalidRequestError(f"chat template rejected the messages: {exc}", param="messages") from exc


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


class Tokenizer:
    """Encode/decode text and render chats for one model directory."""

    def __init__(self, model_dir: Path) -> None:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.exists():
            raise ModelLoadError(f"{model_dir} has no tokenizer.json")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception on malformed files
            raise ModelLoadError(f"cannot load {path}: {exc}") from exc
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        special = {"bos_token": self.bos_token, "eos_token": self.eos_token}
        source = config.get("chat_template")
        template_file = model_dir / "chat_template.jinja"
        if template_file.exists():
            source = template_file.read_text()
        if isinstance(source, list):  # named templates: take the default one
            source = next((t["template"] for t in source if t.get("name") == "default"), None)
        self.chat_template = ChatTemplate(source, special) if source else None

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json holds it (grammar libraries build their vocabulary from it)."""
        return self._tok.to_str()

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids of `text` and each token's (start, end) character span in it."""
        encoding = self._tok.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    add_generation_prompt: bool = True) -> str:
        if self.chat_template is None:
            raise InvalidRequestError("this model has no chat template; use /v1/completions", param="messages")
        return self.chat_template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools)
