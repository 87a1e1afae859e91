"""PlanSeal: the engine follows a SegmentPlan only if the gateway sealed it.

A plan names the tenant whose caches a request may read (its `app_id`), so a plan a
client wrote itself could read another tenant's cached KV, or time it. The gateway and
the engine share a secret; the gateway puts `kv_transfer_params["kvrelay_seal"] =
{"t": issued unix seconds, "mac": HMAC-SHA256(secret, "<t>." + canonical plan JSON)}`
next to the plan, and the engine checks it:

- a plan without a seal, with a wrong MAC (forged, or altered in transit) or issued more
  than `max_age_s` ago (a stale plan replayed) is ignored: the request runs densely
  under the default tenant, with a warning and a count by reason, never an error for
  the user;
- the canonical JSON is the plan dict with sorted keys and no spaces, which both sides
  build from the same JSON values, so no field can change without the MAC changing.

The gateway also drops any plan or seal a client sends, and never returns them.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import time
from collections import Counter
from collections.abc import Mapping
from typing import Any, Literal, NamedTuple

SEAL_KEY = "kvrelay_seal"  # under kv_transfer_params, next to the plan (PLAN_KEY)
MAX_CLOCK_SKEW_S = 30.0

Rejection = Literal["unsealed", "malformed", "forged", "stale"]


class SealCheck(NamedTuple):
    accepted: bool
    reason: Rejection | None = None


def canonical(plan: Any) -> bytes:
    """Sorted keys, no spaces, ASCII only (escapes, so even a lone surrogate encodes)."""
    return json.dumps(plan, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


class PlanSeal:
    """Seals plans (gateway) and checks them (engine) with one shared secret."""

    def __init__(self, secret: str, max_age_s: float = 300.0) -> None:
        if len(secret) < 16:
            raise ValueError("the plan secret must have at least 16 characters")
        if max_age_s <= 0:
            raise ValueError("max_age_s must be positive")
        self._key = secret.encode()
        self.max_age_s = max_age_s
        self.rejected: Counter[str] = Counter()  # reason -> plans ignored (the engine's metric)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> PlanSeal | None:
        """The seal an engine process uses: KVRELAY_PLAN_SECRET (the gateway's
        plan_secret) and KVRELAY_PLAN_MAX_AGE_S (its plan_max_age_s; default 300), or
        None without a secret. Raises ValueError on a bad value."""
        env = os.environ if env is None else env
        secret = env.get("KVRELAY_PLAN_SECRET") or None
        if secret is None:
            return None
        max_age = env.get("KVRELAY_PLAN_MAX_AGE_S") or "300"
        try:
            return cls(secret, float(max_age))
        except ValueError as exc:
            raise ValueError(f"KVRELAY_PLAN_SECRET / KVRELAY_PLAN_MAX_AGE_S: {exc}") from exc

    def _mac(self, issued: int, plan: Any) -> str:
        return hmac.new(self._key, str(issued).encode() + b"." + canonical(plan), hashlib.sha256).hexdigest()

    def seal(self, plan: Any, now: float | None = None) -> dict[str, Any]:
        """The seal for a plan (its JSON dict), to put under kv_transfer_params[SEAL_KEY]."""
        issued = int(time.time() if now is None else now)
        return {"t": issued, "mac": self._mac(issued, plan)}

    def check(self, plan: Any, seal: Any, now: float | None = None) -> SealCheck:
        """Whether to follow `plan`; a rejection is counted under its reason."""
        result = self._check(plan, seal, time.time() if now is None else now)
        if not result.accepted and result.reason is not None:
            self.rejected[result.reason] += 1
        return result

    def _check(self, plan: Any, seal: Any, now: float) -> SealCheck:
        if seal is None:
            return SealCheck(False, "unsealed")
        if not isinstance(seal, dict) or not isinstance(seal.get("mac"), str) \
                or not isinstance(seal.get("t"), int) or isinstance(seal.get("t"), bool):
            return SealCheck(False, "malformed")
        try:
            expected = self._mac(seal["t"], plan)
            genuine = hmac.compare_digest(seal["mac"].encode(), expected.encode())
        except (UnicodeError, TypeError, ValueError, RecursionError):  # not JSON-able as a plan, or not a hex MAC
            return SealCheck(False, "malformed")
        if not genuine:
            return SealCheck(False, "forged")
        if not now - self.max_age_s <= seal["t"] <= now + MAX_CLOCK_SKEW_S:
            return SealCheck(False, "stale")
        return SealCheck(True)
