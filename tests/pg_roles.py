"""Owns the tests' two Postgres roles: the owner (``postgres``, which migrates) and the
runtime role the daemons run as, given its rights by the product's own `schedctl db grant
--apply` code (schedctl/storage/db/roles.py), exactly as an operator would."""

from __future__ import annotations

from contextlib import closing

from schedctl.storage.db.roles import apply_grants, runtime_grants
from schedctl.storage.db.store import Store
from tests.services.postgres import PostgresServer

RUNTIME_ROLE = "schedctl_runtime"


def grant_runtime_role(server: PostgresServer, dbname: str) -> str:
    """Create the runtime role if needed, grant it its rights on the migrated database
    ``dbname`` (as the owner) and return that database's URL as the runtime role. A
    database copied from this one as a template keeps the grants (they are its catalog's)."""
    server.ensure_role(RUNTIME_ROLE)
    with closing(Store.open(server.url(dbname))) as store:
        apply_grants(store, runtime_grants(store, RUNTIME_ROLE))
    return server.url(dbname, user=RUNTIME_ROLE)


def runtime_url(server: PostgresServer, dbname: str) -> str:
    """``dbname``'s URL as the runtime role (granted on the template it was copied from)."""
    return server.url(dbname, user=RUNTIME_ROLE)
