"""Owns the process-wide cache of verified API tokens: token hash -> (tenant, token id) for
TOKEN_CACHE_SECONDS, so that the API does not look a token up in the database on every
request.

Bounds, which docs/api.md ("Auth and tokens") states: a token revoked, or a tenant changed
(allow-list, quotas), by this process is dropped from the cache at once; by another process
(`schedctl tenant token revoke` on another machine) it keeps working here for at most
TOKEN_CACHE_SECONDS. Only tokens the database verified are cached (an unknown or revoked
token is looked up every time), keyed by the token's sha256 and the database, so a token
only ever maps to the tenant the database gave it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from schedctl.domain.host_scope import HostScope
from schedctl.domain.models import Tenant

# what a verified token stands for: its tenant, its id, and its host (None: a tenant token)
Verified = tuple[Tenant, str, HostScope | None]

TOKEN_CACHE_SECONDS = 5.0
# past this many tokens the cache starts over: bounded memory, whatever the callers send
MAX_CACHED_TOKENS = 10_000


class TokenCache:
    """(database, token hash) -> (tenant, token id, host scope), each entry valid for `ttl`
    seconds of `clock` (monotonic; injectable for the tests)."""

    def __init__(
        self, ttl: float = TOKEN_CACHE_SECONDS, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.ttl = ttl
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[tuple[str, str], tuple[float, Verified]] = {}
        # bumped by every forget(): a lookup that began before one is not cached, so a
        # revocation in this process cannot be undone by a lookup racing it
        self.generation = 0

    def get(self, database: str, token_hash: str) -> Verified | None:
        entry = self._entries.get((database, token_hash))
        if entry is None:
            return None
        expires, verified = entry
        if self._clock() >= expires:
            with self._lock:
                if self._entries.get((database, token_hash)) is entry:
                    del self._entries[(database, token_hash)]
            return None
        return verified

    def put(
        self,
        database: str,
        token_hash: str,
        tenant: Tenant,
        token_id: str,
        *,
        generation: int,
        scope: HostScope | None = None,
    ) -> None:
        """Cache a token the database just verified; `generation` is self.generation read
        before the lookup began (the entry is dropped if anything was forgotten since)."""
        if self.ttl <= 0:
            return
        with self._lock:
            if generation != self.generation:
                return
            if len(self._entries) >= MAX_CACHED_TOKENS:
                self._entries.clear()
            self._entries[(database, token_hash)] = (
                self._clock() + self.ttl,
                (tenant, token_id, scope),
            )

    def forget(self, *, token_id: str | None = None, tenant_id: str | None = None) -> None:
        """Drop the entries of a token (revoked) or of a tenant (changed), in every
        database: dropping too much only costs a lookup."""
        with self._lock:
            self.generation += 1
            stale = [
                key
                for key, (_, (tenant, cached_id, _scope)) in self._entries.items()
                if cached_id == token_id or tenant.tenant_id == tenant_id
            ]
            for key in stale:
                del self._entries[key]

    def clear(self) -> None:
        with self._lock:
            self.generation += 1
            self._entries.clear()


VERIFIED_TOKENS = TokenCache()
