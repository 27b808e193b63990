"""Owns the runtime role's grants (`schedctl db grant`): the exact statements that let the
daemons' database role read and write the scheduler's tables and use their sequences, and
nothing more (no DDL, no TRUNCATE), and applying them as the owner role.

Two roles: the owner runs `schedctl db upgrade` and `schedctl db maintain` (it owns every
table, so it alone may change the schema and make or drop day partitions of runs); the
dispatcher, relay, worker and API run as the runtime role. Default privileges make the
tables a later migration creates (as the same owner) the runtime role's too."""

from __future__ import annotations

import re
from dataclasses import dataclass

from sqlalchemy import text
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError

from schedctl.core import errors
from schedctl.storage.db.engine import first_line
from schedctl.storage.db.store import Store

# a plain identifier: what operators name roles, and nothing a shell or a log mangles
_ROLE = re.compile(r"[A-Za-z_][A-Za-z0-9_$]{0,62}")


@dataclass(frozen=True)
class RoleGrants:
    """runtime_grants: the statements, and what the role could still do beyond them
    (notes for the operator: a superuser, a schema anyone may create in)."""

    statements: tuple[str, ...]
    notes: tuple[str, ...]


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
    if store.dialect.embedded:
        # a file: who may open it is the file system's business
        raise errors.ValidationError(
            "database roles do not apply to an embedded file database: the file's owner "
            "and mode decide who may open it",
            field="database_url",
        )
    with store.read() as connection:
        return _postgres_grants(connection, role)


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


def _postgres_grants(connection: Connection, role: str) -> RoleGrants:
    """The grants on Postgres, read from its catalog as this session's role."""
    found = connection.execute(
        text(
            "SELECT r.rolsuper, r.rolbypassrls, pg_has_role(:role, current_user, 'USAGE'),"
            " current_database(), current_schema(), current_user,"
            " has_schema_privilege(:role, current_schema(), 'CREATE')"
            " FROM pg_roles r WHERE r.rolname = :role"
        ),
        {"role": role},
    ).one_or_none()
    if found is None:
        raise errors.NotFound(
            f"no role {role!r} in this cluster: create it first "
            f"(CREATE ROLE {_ident(role)} LOGIN PASSWORD '...')",
            field="role",
        )
    superuser, bypass_rls, is_owner, database, namespace, owner, may_create = found
    if superuser:
        raise errors.ValidationError(
            f"{role!r} is a superuser: no grant limits it (ALTER ROLE {_ident(role)} "
            "NOSUPERUSER, or another role)",
            field="role",
        )
    if is_owner:
        raise errors.ValidationError(
            f"{role!r} is (or is a member of) {owner!r}, the role running this command "
            "and owning the tables: the runtime role must be another one",
            field="role",
        )
    found_rows = connection.execute(
        text(
            "SELECT c.relname::text, c.relkind::text, pg_get_userbyid(c.relowner)::text,"
            " pg_has_role(current_user, c.relowner, 'USAGE') FROM pg_class c"
            " JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE n.nspname = current_schema() AND c.relkind IN ('r', 'p', 'S')"
            " AND NOT c.relispartition ORDER BY c.relname"
        )
    ).all()
    # a GRANT by a role that may not grant only warns ("no privileges were granted"):
    # whoever runs this must own what it grants, or it would report a success
    foreign = sorted({str(r[2]) for r in found_rows if not r[3]})
    if foreign:
        raise errors.ConfigError(
            f"{owner!r} does not own the scheduler's tables (owned by "
            f"{', '.join(map(repr, foreign))}): run it as the role that owns them "
            "(the one that runs `schedctl db upgrade`)",
            field="database_url",
        )
    rows = [(str(r[0]), str(r[1])) for r in found_rows]
    owners = sorted({str(r[2]) for r in found_rows})
    # the scheduler's tables (the version table: read, to check the schema's revision)
    version_table = "alembic_version"
    tables = [name for name, kind in rows if kind in ("r", "p") and name != version_table]
    sequences = [name for name, kind in rows if kind == "S"]
    if not tables:
        raise errors.ValidationError(
            f"schema {namespace!r} of {database!r} has no tables: run `schedctl db upgrade` first",
            field="database_url",
        )
    who, where, table_list = _ident(role), _ident(namespace), ", ".join(map(_ident, tables))
    dml = "SELECT, INSERT, UPDATE, DELETE"
    statements = [
        f"GRANT CONNECT ON DATABASE {_ident(database)} TO {who}",
        f"GRANT USAGE ON SCHEMA {where} TO {who}",
        # what it held before (TRUNCATE, REFERENCES, TRIGGER) goes: the grants are exact
        f"REVOKE ALL ON TABLE {table_list} FROM {who}",
        f"GRANT {dml} ON TABLE {table_list} TO {who}",
    ]
    if version_table in {name for name, _ in rows}:
        statements.append(f"GRANT SELECT ON TABLE {_ident(version_table)} TO {who}")
    if sequences:
        statements.append(f"GRANT USAGE ON SEQUENCE {', '.join(map(_ident, sequences))} TO {who}")
    # the tables and sequences a later migration creates (run by the same owner) are
    # the runtime role's at once: no grant step to forget after `db upgrade`
    for table_owner in owners or [owner]:
        for kind, rights in (("TABLES", dml), ("SEQUENCES", "USAGE")):
            statements.append(
                f"ALTER DEFAULT PRIVILEGES FOR ROLE {_ident(table_owner)} IN SCHEMA "
                f"{where} GRANT {rights} ON {kind} TO {who}"
            )
    notes = []
    if bypass_rls:
        notes.append(f"{role!r} bypasses row-level security (ALTER ROLE NOBYPASSRLS)")
    if may_create:
        notes.append(
            f"{role!r} may create tables in schema {namespace!r} (granted to it or to "
            f"PUBLIC): REVOKE CREATE ON SCHEMA {where} FROM PUBLIC, {who}"
        )
    return RoleGrants(statements=tuple(statements), notes=tuple(notes))


def _ident(name: str) -> str:
    """`name` as a double-quoted SQL identifier."""
    return '"' + name.replace('"', '""') + '"'
