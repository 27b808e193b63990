"""Schema migrations with alembic: upgrade online (idempotent), downgrade, current and head
revisions, and the compatibility rule that decides which schema a daemon may run against.

Compatibility (expand, then contract). Each migration module declares `compatible_with`: the
oldest revision whose daemons still work against the schema it leaves. An additive migration
(a new table, a nullable column, an index) keeps the previous migration's floor; a contract
migration (drops or renames what older code reads or writes, adds a NOT NULL column without a
default) raises it to its own revision. Every migration step (up or down) records the floor
of the revision it leaves in settings[`schema_floor`], in its own transaction, so a daemon
that has never seen a newer migration's file can still read its floor. A daemon whose head
revision is H accepts:
- the database at H;
- a database at a revision it does not know (a newer release's) whose recorded floor is H or
  a revision before H;
and refuses any other: an older revision (run `schedctl db upgrade`), or a newer one whose
floor is after H (install the release of that floor or later). `schema_check` is that rule.

Online upgrade. Each migration runs in its own transaction with a lock timeout
(LOCK_TIMEOUT_MS on Postgres): a migration that cannot take its lock at once gives up, rolls
back and is tried again after a backoff (MIGRATION_ATTEMPTS in all), so it never queues the
daemons' transactions behind it for longer than about a second. See migrations/README.md.

Alembic itself is imported only to migrate: the revision checks every command makes read
the migration files' `revision`/`down_revision` lines and the `alembic_version` table
directly, so a CLI command on an up-to-date database does not load alembic (tests check the
answers equal alembic's)."""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import inspect, text
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import SQLAlchemyError

from schedctl.core import errors
from schedctl.storage.db.engine import check_connection, first_line, make_engine

if TYPE_CHECKING:
    from alembic.config import Config

MIGRATIONS = Path(__file__).with_name("migrations")
log = logging.getLogger(__name__)
VERSION_TABLE = "alembic_version"  # alembic's default; env.py does not change it
_ASSIGNMENT = re.compile(r"^(revision|down_revision)\s*(?::[^=]*)?=\s*(.+?)\s*$", re.MULTILINE)


def _config(connection: Connection | None = None) -> Config:
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    if connection is not None:
        config.attributes["connection"] = connection
    return config


@cache
def revisions() -> dict[str, str | None]:
    """Every migration's revision -> its down_revision, from the files in versions/."""
    found: dict[str, str | None] = {}
    for path in sorted((MIGRATIONS / "versions").glob("*.py")):
        values = dict(_ASSIGNMENT.findall(path.read_text(encoding="utf-8")))
        if "revision" not in values:
            continue
        down = values.get("down_revision", "None").strip("\"'")
        found[values["revision"].strip("\"'")] = None if down == "None" else down
    return found


def head_revision() -> str:
    """The one revision no other revision revises (alembic's head of a linear history)."""
    graph = revisions()
    heads = sorted(set(graph) - {down for down in graph.values() if down is not None})
    if len(heads) != 1:
        raise errors.SchedError(f"the migrations have {len(heads)} heads: {heads}")
    return heads[0]


def current_revision(engine: Engine) -> str | None:
    """The database's revision (None: never migrated); several rows are joined with ','.
    StoreUnavailable, saying why, when the database cannot be reached."""
    check_connection(engine)
    with engine.connect() as connection:
        if not inspect(connection).has_table(VERSION_TABLE):
            return None
        rows = connection.execute(text(f"SELECT version_num FROM {VERSION_TABLE}")).scalars()
        found = sorted(str(row) for row in rows)
    return ",".join(found) if found else None


def is_empty(engine: Engine) -> bool:
    """True when the database has no tables at all (a new SQLite file, say)."""
    with engine.connect() as connection:
        return not inspect(connection).get_table_names()


def upgrade_engine(engine: Engine, revision: str = "head") -> tuple[str | None, str | None]:
    """Upgrade to `revision`; returns (before, after). Running it again changes nothing."""
    before = current_revision(engine)
    upgrade_steps(engine, revision)
    return before, current_revision(engine)


def upgrade(url: str, revision: str = "head") -> tuple[str | None, str | None]:
    engine = make_engine(url)
    try:
        return upgrade_engine(engine, revision)
    finally:
        engine.dispose()


# -- compatibility ----------------------------------------------------------------------

FLOOR_SETTING = "schema_floor"  # settings key: the floor of the database's revision
_FLOOR = re.compile(r"^compatible_with\s*(?::[^=]*)?=\s*(.+?)\s*$", re.MULTILINE)


@cache
def floors() -> dict[str, str]:
    """Every migration's revision -> its `compatible_with` (its own revision when it does
    not declare one: an undeclared migration is taken as a contract)."""
    found: dict[str, str] = {}
    for path in sorted((MIGRATIONS / "versions").glob("*.py")):
        text_ = path.read_text(encoding="utf-8")
        values = dict(_ASSIGNMENT.findall(text_))
        if "revision" not in values:
            continue
        revision = values["revision"].strip("\"'")
        match = _FLOOR.search(text_)
        found[revision] = match.group(1).strip("\"'") if match else revision
    return found


def lineage(revision: str) -> list[str]:
    """`revision` and every revision before it, oldest first (empty if unknown)."""
    graph = revisions()
    chain: list[str] = []
    current: str | None = revision
    while current is not None and current in graph and len(chain) <= len(graph):
        chain.append(current)
        current = graph[current]
    return list(reversed(chain))


@dataclass(frozen=True)
class SchemaCheck:
    """What a daemon of head revision `head` makes of the database at `current`."""

    current: str | None
    head: str
    floor: str | None  # the database's recorded floor (None: not recorded)
    state: str  # "current", "compatible", "behind", "too_new"

    @property
    def usable(self) -> bool:
        return self.state in ("current", "compatible")

    def message(self, where: str) -> str:
        if self.state == "current":
            return f"{where} is at schema revision {self.head}, this version's"
        if self.state == "compatible":
            return (
                f"{where} is at schema revision {self.current}, newer than this version's "
                f"{self.head} and declared compatible with it (floor {self.floor})"
            )
        if self.state == "behind":
            return (
                f"{where} is at schema revision {self.current or 'none (empty)'}, this version "
                f"needs {self.head}: run `schedctl db upgrade`"
            )
        return (
            f"{where} is at schema revision {self.current}, newer than this version's "
            f"{self.head}, and works only with daemons of schema revision "
            f"{self.floor or self.current} or later: install the release whose "
            f"`schedctl db status` shows head {self.floor or self.current} or later (or run "
            "`schedctl db downgrade` with the newer release's schedctl)"
        )


def read_floor(connection: Connection) -> str | None:
    if not inspect(connection).has_table("settings"):
        return None
    value = connection.execute(
        text("SELECT value FROM settings WHERE key = :k"), {"k": FLOOR_SETTING}
    ).scalar_one_or_none()
    return str(value) if value is not None else None


def schema_check(engine: Engine) -> SchemaCheck:
    """The compatibility rule (module docstring) for this version against `engine`'s database."""
    head = head_revision()
    current = current_revision(engine)
    with engine.connect() as connection:
        floor = read_floor(connection)
    if current == head:
        return SchemaCheck(current, head, floor or floors().get(head), "current")
    if current is None or current in revisions():
        # an older revision of this release line (or a fresh database)
        return SchemaCheck(current, head, floor, "behind")
    accepted = floor is not None and floor in lineage(head)
    return SchemaCheck(current, head, floor, "compatible" if accepted else "too_new")


def require_usable_schema(engine: Engine, where: str) -> SchemaCheck:
    """schema_check, raising SchemaOutdated (exit 2) with the command to run when refused."""
    check = schema_check(engine)
    if not check.usable:
        raise errors.SchemaOutdated(check.message(where))
    return check


def record_floor(connection: Connection, revision: str | None) -> None:
    """settings[schema_floor] := the floor of `revision` (removed at base). Each migration
    writes it in its own transaction (env.py), with alembic's version row."""
    if not inspect(connection).has_table("settings"):
        return
    connection.execute(text("DELETE FROM settings WHERE key = :k"), {"k": FLOOR_SETTING})
    if revision is not None:
        connection.execute(
            text("INSERT INTO settings (key, value) VALUES (:k, :v)"),
            {"k": FLOOR_SETTING, "v": floors().get(revision, revision)},
        )


# -- online steps -----------------------------------------------------------------------

LOCK_TIMEOUT_MS = 1000  # no migration waits for (and so blocks others behind) a lock longer
MIGRATION_ATTEMPTS = 20  # per migration step; each failure waits a backoff first
_BACKOFF_FIRST, _BACKOFF_MAX = 0.2, 5.0
_LOCK_NOT_AVAILABLE = "55P03"  # Postgres: lock_timeout expired


@dataclass(frozen=True)
class Step:
    """One migration step as it ran: from -> to, its attempts and its last attempt's time
    (an upper bound on how long it held any lock: the step is one transaction)."""

    source: str | None
    target: str | None
    attempts: int
    seconds: float


def _lock_timed_out(exc: BaseException) -> bool:
    orig = getattr(exc, "orig", None)
    code = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
    return code == _LOCK_NOT_AVAILABLE


def _run_step(engine: Engine, source: str | None, target: str, direction: str) -> Step:
    """One migration (upgrade or downgrade to `target`) with the lock timeout, retried with a
    backoff while it cannot take its locks."""
    import tenacity
    from alembic import command

    attempts = 0
    seconds = 0.0

    def attempt() -> None:
        nonlocal attempts, seconds
        attempts += 1
        started = time.monotonic()
        with engine.connect() as connection:
            if connection.dialect.name == "postgresql":
                # session-wide: also covers CONCURRENTLY steps run outside the transaction
                connection.execute(text(f"SET lock_timeout = {int(LOCK_TIMEOUT_MS)}"))
                connection.commit()
            try:
                config = _config(connection)
                if direction == "up":
                    command.upgrade(config, target)
                else:
                    command.downgrade(config, target)
                connection.commit()
            finally:
                if connection.dialect.name == "postgresql":
                    # the pooled session goes back without it (the engine may serve a daemon)
                    connection.rollback()
                    connection.execute(text("RESET lock_timeout"))
                    connection.commit()
        seconds = time.monotonic() - started
        if seconds * 1000 > LOCK_TIMEOUT_MS:
            log.info("migration %s -> %s took %.2f s", source, target, seconds)

    retrying = tenacity.Retrying(
        retry=tenacity.retry_if_exception(_lock_timed_out),
        stop=tenacity.stop_after_attempt(MIGRATION_ATTEMPTS),
        wait=tenacity.wait_exponential(multiplier=_BACKOFF_FIRST, max=_BACKOFF_MAX)
        + tenacity.wait_random(0, _BACKOFF_FIRST),
        before_sleep=lambda state: log.warning(
            "migration %s -> %s could not take its lock within %d ms (attempt %d of %d): "
            "trying again",
            source,
            target,
            LOCK_TIMEOUT_MS,
            state.attempt_number,
            MIGRATION_ATTEMPTS,
        ),
        reraise=True,
    )
    try:
        retrying(attempt)
    except SQLAlchemyError as exc:
        if _lock_timed_out(exc):
            raise errors.StoreUnavailable(
                f"migration {source or '(empty)'} -> {target} could not take its lock in "
                f"{MIGRATION_ATTEMPTS} attempts of {LOCK_TIMEOUT_MS} ms: a long transaction "
                "holds it (see pg_stat_activity); nothing of this step was applied, run "
                "`schedctl db upgrade` again"
            ) from exc
        raise
    return Step(source, target, attempts, seconds)


def path_up(current: str | None, target: str) -> list[str]:
    """The revisions to apply, in order, from `current` to `target` (both of this release)."""
    chain = lineage(target)
    if current is None:
        return chain
    if current not in chain:
        return []
    return chain[chain.index(current) + 1 :]


def upgrade_steps(engine: Engine, revision: str = "head") -> list[Step]:
    """Upgrade one migration at a time to `revision`; returns the steps run (none: already
    there). A database at a revision this release does not know (a newer release's) is left
    as it is: no steps when it is compatible with this version, SchemaOutdated when not."""
    check_connection(engine)
    target = head_revision() if revision == "head" else revision
    if target not in revisions():
        raise errors.ValidationError(f"unknown schema revision {revision!r}", field="revision")
    current = current_revision(engine)
    if current is not None and current not in revisions():
        # a newer release's schema: left alone; an error only when this version cannot use it
        check = schema_check(engine)
        if check.usable:
            return []
        raise errors.SchemaOutdated(check.message("the database"))
    steps: list[Step] = []
    try:
        source = current
        for step in path_up(current, target):
            steps.append(_run_step(engine, source, step, "up"))
            source = step
        if not steps and current is not None:
            with engine.begin() as connection:
                record_floor(connection, current)  # a database migrated before floors
    except SQLAlchemyError as exc:
        raise errors.StoreUnavailable(f"migration failed: {first_line(exc)}") from exc
    return steps


def downgrade_steps(engine: Engine, to: str | None = None) -> list[Step]:
    """Downgrade one migration at a time: to the previous revision, or to `to` (a revision
    before the current one). Refused at the first revision (below it is no schema at all)
    and on a revision this release does not know (use that release's schedctl)."""
    check_connection(engine)
    graph = revisions()
    current = current_revision(engine)
    if current is None:
        raise errors.Conflict(
            "the database has no schema revision (base): there is nothing to downgrade"
        )
    if current not in graph:
        raise errors.SchemaOutdated(
            f"the database is at schema revision {current}, which this version does not know: "
            "run `schedctl db downgrade` with the schedctl of the release that made it"
        )
    if to is None:
        target = graph[current]
        if target is None:
            raise errors.Conflict(
                f"the database is at the first schema revision {current}: downgrading would "
                "drop every table, refused (drop the database instead if that is meant)"
            )
    else:
        if to not in graph:
            raise errors.ValidationError(f"unknown schema revision {to!r}", field="to")
        if to == current:
            return []
        if to not in lineage(current):
            raise errors.ValidationError(
                f"revision {to} is not before the database's revision {current}: use "
                "`schedctl db upgrade`",
                field="to",
            )
        target = to
    steps: list[Step] = []
    try:
        source = current
        while source != target and source is not None:
            previous = graph[source]
            assert previous is not None  # target is in source's lineage
            steps.append(_run_step(engine, source, previous, "down"))
            source = previous
    except SQLAlchemyError as exc:
        raise errors.StoreUnavailable(f"downgrade failed: {first_line(exc)}") from exc
    return steps
