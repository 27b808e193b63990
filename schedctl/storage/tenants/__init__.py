"""Owns a tenant's storage: the tenant, its tokens and their cache, its delivery settings
and its signing secrets."""
