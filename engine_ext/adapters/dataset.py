"""Training examples from JSONL: one `{"prompt": str, "completion": str}` object per line."""

from __future__ import annotations

import json
from pathlib import Path

from engine_ext.errors import InvalidRequestError
from engine_ext.tokenizer import Tokenizer


def read_examples(path: Path, tokenizer: Tokenizer, limit: int | None = None) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, completion ids) per line; a bad line is refused with its number."""
    examples = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise InvalidRequestError(f"cannot read {path}: {exc.strerror or exc}") from exc
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(f"{path}:{number}: not JSON ({exc.msg})") from exc
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not isinstance(row.get("completion"), str) \
                or not row["completion"]:
            raise InvalidRequestError(f"{path}:{number}: needs a string prompt and a non-empty string completion")
        examples.append((tokenizer.encode(row["prompt"]), tokenizer.encode(row["completion"])))
        if limit is not None and len(examples) >= limit:
            break
    if not examples:
        raise InvalidRequestError(f"{path} holds no examples")
    return examples
