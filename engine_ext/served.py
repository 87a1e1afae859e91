"""What the serving layer reads of the engine, as values: the calls go one way.

The OpenAI service runs on the event loop and the engine on its own thread
(engine_ext/async_engine.py). The service needs a few facts of the loaded model (its
tokenizer, vocabulary, end tokens, context length, adapters, block size) and, for
/metrics, what the reuse methods did. Rather than reaching through the AsyncEngine into
the engine's parts, it reads these records: the model's facts are fixed when the engine
is built, and the counters are a snapshot the engine takes of its own parts.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine_ext.diffs.stored import MirrorRows
from engine_ext.tokenizer import Tokenizer


@dataclass(frozen=True)
class ServedModel:
    """The loaded model's facts, fixed at load: safe to read from any thread."""

    name: str
    tokenizer: Tokenizer
    vocab_size: int
    eos_token_ids: frozenset[int]
    max_model_len: int
    adapter_names: tuple[str, ...]
    block_size: int


@dataclass(frozen=True)
class MirrorCounters:
    """The DiffStore's round caches kept as diffs against their round's master."""

    mirror_bytes: int
    mirrored_dense_bytes: int  # what those caches would take kept densely
    mirrored_rows: int
    mirror_rows: MirrorRows  # the rows their diffs hold verbatim, by why


@dataclass(frozen=True)
class ReuseCounters:
    """What each reuse method did since start; None for a method this engine runs without."""

    kvcomm_tokens: tuple[int, int] | None  # (placed from anchors or another reader's KV, computed to be measured)
    collective: tuple[int, int] | None  # (rounds prefilled collectively, their requests)
    mirrors: MirrorCounters | None
    interrupted_steps: int  # background steps (fidelity probes) an arriving request stopped
