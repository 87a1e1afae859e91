"""EngineRequest: one request as it reaches the engine, whoever sends it.

The server builds it from an HTTP body and its plan, a probe from the request it
re-scores, a test or a benchmark by hand; it travels unchanged through the async
engine's queue to `LLMEngine.add_request`, which checks it against the model and the
KV budget and makes the request's `Sequence`. One record instead of a chain of
positional parameters, so a new field is one line here and one reader.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine_ext.reuse.segments import ReuseScope, TokenSegment
from engine_ext.sampling import SamplingParams


@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    # The caller's kv_transfer_params, echoed back with the engine's reports.
    kv_transfer_params: dict[str, Any] | None = None
    # Token ranges of the prompt from the plan: reuse beyond the prefix cache.
    segments: list[TokenSegment] | None = None
    # Whose caches it reads and fills, its agent, round and workflow (the plan's).
    scope: ReuseScope | None = None
    adapter: str | None = None  # a served LoRA adapter's name (engine_ext/adapters); None: the base model
    publish: bool = True  # False keeps its blocks out of the prefix cache (probes, approximate scoring)
    probe: bool = False  # the gateway's fidelity guard asked for a dense re-score (engine_ext/probes.py)
    # Work no client waits for (a probe's dense score): it runs only in steps no request
    # wants, in chunks of at most `max_chunk_tokens` (None: the step's budget).
    background: bool = False
    max_chunk_tokens: int | None = None
