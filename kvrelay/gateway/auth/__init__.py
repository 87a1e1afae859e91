"""API keys, the admin key and per-key rate limits."""

from __future__ import annotations

from kvrelay.gateway.auth.access import AccessControl, Charge
from kvrelay.gateway.auth.estimate import TokenEstimator
from kvrelay.gateway.auth.keys import CreatedKey, KeyInfo, KeyNotFoundError, KeyStore
from kvrelay.gateway.auth.ratelimit import RateLimiter

__all__ = ["AccessControl", "Charge", "CreatedKey", "KeyInfo", "KeyNotFoundError", "KeyStore", "RateLimiter",
           "TokenEstimator"]
