"""API keys, the admin key and per-key rate limits."""

from __future__ import annotations

from gateway.auth.access import AccessControl, Charge
from gateway.auth.estimate import TokenEstimator
from gateway.auth.keys import CreatedKey, KeyInfo, KeyNotFoundError, KeyStore
from gateway.auth.ratelimit import RateLimiter

__all__ = ["AccessControl", "Charge", "CreatedKey", "KeyInfo", "KeyNotFoundError", "KeyStore", "RateLimiter",
           "TokenEstimator"]
