"""What the engine reports back to the gateway, typed once for both sides.

- The TTFT breakdown: under the response's `kv_transfer_params[TTFT_KEY]`, sent when
  the request carried kv_transfer_params or the TTFT_HEADER (the gateway always sends
  the header). The engine builds it (engine_ext/timeline.py); the gateway keeps it with
  the request record and reads it back for every TTFT view (kvrelay/gateway/ttft.py).
- Fidelity probe scores: GET FIDELITY_PATH?after=N on the engine, polled by the gateway's
  fidelity guard (kvrelay/gateway/fidelity_poll.py).
- The reuse report, per segment, under `kv_transfer_params[REUSE_KEY]`
  (engine_ext/reuse/segments.py): for the caller; the gateway passes it on unread.

The gateway does not trust an upstream to be well formed (a vLLM replica, an older
engine, a broken one): `TtftBreakdown.read` keeps each field that is valid and drops the
rest, and a fidelity page is read score by score.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

TTFT_KEY = "kvrelay_ttft"  # the breakdown under the response's kv_transfer_params
REUSE_KEY = "kvrelay_reuse"  # the per-segment reuse report under the response's kv_transfer_params
# A caller sends this header (any value but 0/false/off) to get the breakdown back even
# without kv_transfer_params: the gateway always does, reuse on or off.
TTFT_HEADER = "x-kvrelay-ttft"
FIDELITY_PATH = "/v1/kvrelay/fidelity"
MAX_METHOD_NAME = 32
MAX_METHODS = 16
MAX_NAME = 256  # a tenant or app name longer than this is not one the gateway sent

Finite = Annotated[float, Field(allow_inf_nan=False)]
Name = Annotated[str, Field(min_length=1, max_length=MAX_NAME)]


def wants_breakdown(headers: Mapping[str, str]) -> bool:
    value = headers.get(TTFT_HEADER)
    return value is not None and value.strip().lower() not in ("0", "false", "off")


class TtftBreakdown(BaseModel):
    """Where one request's time to its first token went, in seconds, and what prefix
    caching alone would have given (`dense_ttft_s`); token counts are numbers too, so
    every field but `assembly_s` reads the same way."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    ttft_s: Finite
    # The engine's contiguous stages up to the first token.
    prepare_s: Finite | None = None
    queue_s: Finite | None = None
    plan_s: Finite | None = None
    prefill_s: Finite | None = None
    first_s: Finite | None = None
    assembly_s: dict[str, Finite] | None = None  # reuse method -> seconds placing KV
    prefill_steps: Finite | None = None
    prefill_compute_s: Finite | None = None
    prefill_wait_s: Finite | None = None
    # The baseline: what prefix caching alone would have served and computed.
    prefix_hit_tokens: Finite | None = None
    prefix_path_tokens: Finite | None = None
    reused_tokens: Finite | None = None
    keep_s: Finite | None = None
    prefix_path_s: Finite | None = None
    dense_ttft_s: Finite | None = None
    saved_s: Finite | None = None

    @classmethod
    def numbers(cls) -> tuple[str, ...]:
        """The names of the numeric fields (every field but `assembly_s`)."""
        return tuple(name for name in cls.model_fields if name != "assembly_s")

    @classmethod
    def read(cls, report: object) -> TtftBreakdown | None:
        """An upstream's breakdown with each valid field kept and the rest dropped; None
        when no TTFT is left. The saving is derived here, once, for every reader:
        `saved_s` = `dense_ttft_s` - `ttft_s`, only where the breakdown names its
        baseline (`prefix_hit_tokens`); a dense TTFT without one is from before savings
        were priced against prefix caching alone, and is dropped."""
        if not isinstance(report, dict):
            return None
        out: dict[str, Any] = {key: float(report[key]) for key in cls.numbers() if _finite(report.get(key))}
        out.pop("saved_s", None)
        methods = report.get("assembly_s")
        if isinstance(methods, dict):
            out["assembly_s"] = {str(m)[:MAX_METHOD_NAME]: float(v)
                                 for m, v in list(methods.items())[:MAX_METHODS] if _finite(v)}
        if "ttft_s" not in out:
            return None
        if "dense_ttft_s" in out and "prefix_hit_tokens" in out:
            out["saved_s"] = out["dense_ttft_s"] - out["ttft_s"]
        else:
            out.pop("dense_ttft_s", None)
        return cls.model_validate(out)

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


def _finite(value: object) -> bool:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int past float's range (JSON allows any number of digits)
        return False


class FidelityScore(BaseModel):
    """One probe: an approximate request scored again densely (top-1 agreement and
    KL(dense || approximate) over its first `tokens` tokens)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    seq: Annotated[int, Field(ge=0)] = 0  # increasing: pollers ask for scores after the last seen
    request_id: str = ""
    tenant: Name
    app: Name
    method: Name
    top1: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]
    kl: Annotated[float, Field(ge=0.0, allow_inf_nan=False)]
    tokens: Annotated[int, Field(ge=0)] = 0

    @classmethod
    def read(cls, item: object) -> FidelityScore | None:
        """A score from an upstream's page, or None when malformed."""
        try:
            return cls.model_validate(item)
        except ValidationError:
            return None


class FidelityPage(BaseModel):
    """GET FIDELITY_PATH?after=N: the scores with seq > N, oldest first; `next` is what
    to ask after next (below N when the engine restarted and numbers from 1 again)."""

    model_config = ConfigDict(frozen=True)

    object: Literal["list"] = "list"
    results: list[FidelityScore]
    next: Annotated[int, Field(ge=0)]
    counters: dict[str, int] = Field(default_factory=dict)
