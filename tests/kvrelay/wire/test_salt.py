"""cache_salt: the values vLLM accepts, the tenant key it makes, and the salt the gateway
derives per tenant namespace."""

from __future__ import annotations

import hashlib
import hmac

import pytest

from kvrelay.wire.salt import MAX_SALT_CHARS, TenantSalts, check_salt, salted_tenant

SECRET = "gateway-engine-" + "k" * 20


@pytest.mark.parametrize("value", ["a", "team-7", "x" * MAX_SALT_CHARS, "ünï"])
def test_salts_vllm_accepts_pass(value):
    assert check_salt(value) == value


@pytest.mark.parametrize("value", ["", 7, ["a"], {"a": 1}, "x" * (MAX_SALT_CHARS + 1), "a@b", "a/b", "a\\b", "a\0b"])
def test_salts_vllm_refuses_are_refused(value):
    with pytest.raises(ValueError, match="cache_salt"):
        check_salt(value)


def test_no_salt_is_no_salt():
    assert check_salt(None) is None
    assert salted_tenant("app:a", None) == "app:a"


def test_a_salt_splits_a_tenant_and_never_joins_two():
    keys = {salted_tenant(tenant, salt) for tenant in ("app:a", "app:b") for salt in (None, "s", "t")}
    assert len(keys) == 6
    assert salted_tenant("app:a", "s") == salted_tenant("app:a", "s")


def test_the_gateway_s_salt_is_per_namespace_keyed_and_valid():
    salts = TenantSalts(SECRET)
    a, b = salts.salt("app:a"), salts.salt("app:b")
    assert a != b and a == TenantSalts(SECRET).salt("app:a")  # the same on every replica, after restarts
    assert TenantSalts("another-secret-" + "q" * 20).salt("app:a") != a  # unguessable without the secret
    assert TenantSalts(None).salt("app:a") not in (a, TenantSalts(None).salt("app:b"))
    assert salts.salt("app:a", "user-1") not in (a, salts.salt("app:a", "user-2"), "user-1")
    for salt in (a, salts.salt("app:a", "x" * MAX_SALT_CHARS), TenantSalts(None).salt("group:1")):
        assert check_salt(salt) == salt


def test_the_salt_is_hmac_sha256_of_the_namespace_and_client_salt():
    """Its value is a contract: engines keep a tenant's cached KV across gateway upgrades
    and replicas only while every gateway derives the same salt."""
    key = b"cache_salt\0" + SECRET.encode()
    assert TenantSalts(SECRET).salt("app:x", "mine") == hmac.new(key, b"app:x\0mine", hashlib.sha256).hexdigest()
    assert TenantSalts(SECRET).salt("app:x") == hmac.new(key, b"app:x\0", hashlib.sha256).hexdigest()


def test_cached_salts_stay_the_derived_ones_past_the_cache_s_bound():
    salts, fresh = TenantSalts(SECRET, max_cached=4), TenantSalts(SECRET)
    asked = [("app:a", None), ("app:a", "u1"), ("app:b", None)] + [("app:c", f"u{i}") for i in range(10)]
    for namespace, client in asked * 2:  # the second pass reads cached salts, and some evicted ones again
        assert salts.salt(namespace, client) == fresh.salt(namespace, client)
    assert len(salts._cached) <= 4
