"""Training examples from JSONL, one object per line, in either of two shapes:

- `{"prompt": str, "completion": str}`: raw text, as /v1/completions serves it;
- `{"messages": [...]}`: a chat ending in the assistant's answer, rendered with the
  model's chat template as /v1/chat/completions serves it; the answer ends with the
  end-of-sequence token so the adapter learns to stop.
"""

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
        if isinstance(row, dict) and "messages" in row:
            examples.append(_chat_example(row["messages"], tokenizer, f"{path}:{number}"))
        elif isinstance(row, dict) and isinstance(row.get("prompt"), str) and isinstance(row.get("completion"), str) \
                and row["prompt"] and row["completion"]:
            examples.append((tokenizer.encode(row["prompt"]), tokenizer.encode(row["completion"])))
        else:
            raise InvalidRequestError(f"{path}:{number}: needs a non-empty string prompt and completion, "
                                      "or messages")
        if limit is not None and len(examples) >= limit:
            break
    if not examples:
        raise InvalidRequestError(f"{path} holds no examples")
    return examples


def _chat_example(messages: object, tokenizer: Tokenizer, where: str) -> tuple[list[int], list[int]]:
    """The chat before the last message, templated with the generation prompt; the last
    (assistant) message's content and the end-of-sequence token."""
    if not isinstance(messages, list) or len(messages) < 2 or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise InvalidRequestError(f"{where}: messages must be at least two {{role, content}} objects")
    if messages[-1]["role"] != "assistant" or not messages[-1]["content"]:
        raise InvalidRequestError(f"{where}: the last message must be the assistant's non-empty answer")
    prompt = tokenizer.encode(tokenizer.render_chat(messages[:-1], add_generation_prompt=True))
    eos = tokenizer.token_id(tokenizer.eos_token)
    return prompt, tokenizer.encode(messages[-1]["content"]) + ([] if eos is None else [eos])
