"""Owns the runtime role's grants (`schedctl db grant`): the exact statements that let the
daemons' database role read and write the scheduler's tables and use their sequences, and
nothing more (no DDL, no TRUNCATE), and applying them as the owner role.

Two roles: the owner runs `schedctl db upgrade` and `schedctl db maintain` (it owns every
table, so it alone may change the schema and make or drop day partitions of runs); the
dispatcher, relay, worker and API run as the runtime role. Default privileges make the
tables a later migration creates (as the same owner) the runtime role's too."""

from __future__ import annotations

import re

from sqlalchemy.exc import DBAPIError

from schedctl import errors
from schedctl.storage.backend.dialect import RoleGrants
from schedctl.storage.db.engine import first_line
from schedctl.storage.db.store import Store

# a plain identifier: what operators name roles, and nothing a shell or a log mangles
_ROLE = re.compile(r"[A-Za-z_][A-Za-z0-9_$]{0,62}")


def check_role_name(role: str) -> str:
    if not _ROLE.fullmatch(role):
        raise errors.ValidationError(
            "a role name is a letter or _ then letters, digits, _ or $ (at most 63)",
            field="role",
        )
    return role


def runtime_grants(store: Store, role: str) -> RoleGrants:
    """The statements for `role` on the store's database, as the store's role would run
    them; ValidationError where the database has no roles (an embedded file)."""
    check_role_name(role)
    with store.read() as connection:
        grants = store.dialect.runtime_grants(connection, role)
    if grants is None:
        raise errors.ValidationError(
            "database roles do not apply to an embedded file database: the file's owner "
            "and mode decide who may open it",
            field="database_url",
        )
    return grants


def apply_grants(store: Store, grants: RoleGrants) -> None:
    """Run the statements in one transaction (all or none)."""
    try:
        with store.tx() as connection:
            for statement in grants.statements:
                connection.exec_driver_sql(statement)
    except DBAPIError as exc:
        # not the owner (or not allowed to grant): the database's own reason
        raise errors.ConfigError(
            f"granting failed (run it as the role that owns the tables): {first_line(exc)}",
            field="database_url",
        ) from exc
