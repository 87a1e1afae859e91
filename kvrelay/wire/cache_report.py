"""What an engine tells the gateway about the KV it holds, for cache-aware routing.

Two reports, both in the engine's own block terms (its chained block hashes, which cover
the model, the tenant and every token before the block):

- per request, under the response's `kv_transfer_params[BLOCKS_KEY]`, when the request
  carried BLOCKS_HEADER (the gateway sends it only under its `cache_aware` policy):
  the digests of the prompt's full blocks, in order. The gateway cannot tokenize; from these it learns
  which blocks a later prompt that extends this one will start with.
- per engine, GET CACHE_PATH: the digests of every block it holds now, on the device and
  in its lower tiers (host memory, disk). The gateway polls it, as vLLM's KV events or
  Dynamo's router feed a router, and scores each replica by how many of a prompt's
  predicted blocks it holds, from the first one on.

A digest is the first 8 bytes of the 16-byte block hash, in hex: collisions among the
few hundred thousand blocks a replica holds are out of reach (2^-64 per pair), and a
collision would only misroute, never change an answer. The gateway reads both reports
tolerantly: anything malformed is dropped, never trusted.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError

BLOCKS_KEY = "kvrelay_blocks"  # the prompt's block digests under the response's kv_transfer_params
BLOCKS_HEADER = "x-kvrelay-blocks"  # a caller sends it (any value but 0/false/off) to get BLOCKS_KEY back
CACHE_PATH = "/v1/kvrelay/cache"
DIGEST_BYTES = 8
MAX_PROMPT_BLOCKS = 8192  # a prompt of SmolLM2's whole context in 1-token blocks would be 8192
MAX_REPORTED_BLOCKS = 1 << 20  # device and lower tiers together
_DIGEST = re.compile(r"[0-9a-f]{16}")


def wants_blocks(headers: Mapping[str, str]) -> bool:
    value = headers.get(BLOCKS_HEADER)
    return value is not None and value.strip().lower() not in ("0", "false", "off")


def digest(block_hash: bytes) -> str:
    return block_hash[:DIGEST_BYTES].hex()


def digests(block_hashes: Iterable[bytes]) -> list[str]:
    return [h[:DIGEST_BYTES].hex() for h in block_hashes]


class CacheReport(BaseModel):
    """An engine's resident blocks. `device`: in its KV pool (running or cached); `lower`:
    only in a lower tier, loadable back without recomputing."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    block_size: int = Field(ge=1, le=4096)
    device: list[str] = Field(max_length=MAX_REPORTED_BLOCKS)
    lower: list[str] = Field(default_factory=list, max_length=MAX_REPORTED_BLOCKS)

    @classmethod
    def read(cls, body: object) -> CacheReport | None:
        """An upstream's report, or None when it is not one (digests of the wrong shape
        are dropped one by one)."""
        try:
            report = cls.model_validate(body)
        except ValidationError:
            return None
        return report.model_copy(update={"device": [d for d in report.device if _DIGEST.fullmatch(d)],
                                         "lower": [d for d in report.lower if _DIGEST.fullmatch(d)]})


def read_prompt_blocks(params: object) -> list[str] | None:
    """The prompt's block digests from a response's kv_transfer_params, or None when they
    are missing or malformed (the whole list: a gap would shift every later block)."""
    if not isinstance(params, dict):
        return None
    blocks = params.get(BLOCKS_KEY)
    if not isinstance(blocks, list) or len(blocks) > MAX_PROMPT_BLOCKS:
        return None
    if not all(isinstance(d, str) and _DIGEST.fullmatch(d) for d in blocks):
        return None
    return blocks
