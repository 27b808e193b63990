"""The verified-token cache: entries expire after the TTL, forget() drops a token's or a
tenant's entries, and a lookup that began before a forget() is not cached."""

from __future__ import annotations

from datetime import UTC, datetime

from schedctl.domain.models import Tenant
from schedctl.storage.tenants.token_cache import TokenCache


def _tenant(tenant_id: str) -> Tenant:
    return Tenant(tenant_id, tenant_id, 10, 10, 10, (), datetime(2026, 1, 1, tzinfo=UTC))


def test_entries_expire_after_the_ttl() -> None:
    now = [0.0]
    cache = TokenCache(ttl=5.0, clock=lambda: now[0])
    cache.put("db", "h1", _tenant("a"), "t1", generation=cache.generation)
    now[0] = 4.9
    assert cache.get("db", "h1") == (_tenant("a"), "t1", None)
    assert cache.get("other-db", "h1") is None
    now[0] = 5.0
    assert cache.get("db", "h1") is None


def test_forget_drops_a_token_or_a_tenant_and_stale_lookups() -> None:
    cache = TokenCache(ttl=5.0, clock=lambda: 0.0)
    for token_hash, tenant, token_id in (("h1", "a", "t1"), ("h2", "a", "t2"), ("h3", "b", "t3")):
        cache.put("db", token_hash, _tenant(tenant), token_id, generation=cache.generation)
    cache.forget(token_id="t1")
    assert cache.get("db", "h1") is None and cache.get("db", "h2") is not None
    cache.forget(tenant_id="a")
    assert cache.get("db", "h2") is None and cache.get("db", "h3") is not None
    began = cache.generation
    cache.forget(token_id="t9")  # a revocation while a lookup was on its way
    cache.put("db", "h9", _tenant("a"), "t9", generation=began)
    assert cache.get("db", "h9") is None


def test_a_zero_ttl_caches_nothing() -> None:
    cache = TokenCache(ttl=0.0)
    cache.put("db", "h1", _tenant("a"), "t1", generation=cache.generation)
    assert cache.get("db", "h1") is None
