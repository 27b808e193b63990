"""The Store: one engine and its dialect, transactions that turn driver errors into SchedErrors,
the DB clock."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DBAPIError, OperationalError, SQLAlchemyError

from schedctl.core import errors
from schedctl.storage.backend.dialect import Dialect, dialect_named, known_dialects
from schedctl.storage.db import schema
from schedctl.storage.db.engine import (
    APPLICATION_NAME,
    READ_ONLY_OPTION,
    check_connection,
    first_line,
    make_engine,
    redact,
)

DEFAULT_PARTITION_COUNT = 1024

log = logging.getLogger(__name__)


def is_lock_race(exc: BaseException | None) -> bool:
    """True for a lost lock race however it arrives: the driver's exception itself (a
    statement run on the raw driver cursor), its SQLAlchemy wrapper (`.orig`), or an
    error raised from either (`__cause__`/`__context__`, e.g. StoreUnavailable). Which
    driver exception is one, each dialect says."""
    dialects = known_dialects().values()
    seen: set[int] = set()
    pending = [exc]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, errors.LockRace):
            return True
        if any(dialect.is_lock_race(current) for dialect in dialects):
            return True
        pending.append(getattr(current, "orig", None))
        pending.append(current.__cause__)
        pending.append(current.__context__)
    return False


def _is_driver_operational_error(exc: BaseException) -> bool:
    """The driver's own OperationalError (connection lost, server shutting down), raised
    unwrapped by statements run on the raw driver cursor."""
    drivers = {dialect.driver for dialect in known_dialects().values()}
    return any(
        cls.__name__ == "OperationalError" and cls.__module__.split(".")[0] in drivers
        for cls in type(exc).__mro__
    )


class Store:
    """Owns the engine; every database access goes through `tx()` or `read()`."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        # the one place a backend is chosen: everything that differs asks self.dialect
        self.dialect: Dialect = dialect_named(engine.dialect.name)
        self._partition_count: int | None = None
        # whether a write transaction ran: only then is there a log to checkpoint at close
        # (a look, `schedctl job list`, must not wait for a busy daemon's readers)
        self._wrote = False

    @classmethod
    def open(
        cls,
        url: str,
        *,
        upgrade: bool = False,
        check: bool = True,
        application_name: str = APPLICATION_NAME,
    ) -> Store:
        """Connect; with upgrade=True migrate to head first (the embedded default does).
        `application_name`: who this process is, in Postgres's pg_stat_activity."""
        store = cls(make_engine(url, application_name=application_name))
        try:
            if upgrade:
                # migrating loads alembic: only here, not for every CLI command
                from schedctl.storage.db.migrate import schema_check, upgrade_engine

                check_connection(store.engine)
                if schema_check(store.engine).state == "behind":
                    upgrade_engine(store.engine)
                else:
                    # a newer release's schema is used as it is (when compatible), never migrated
                    store.require_current_schema()
                store.ensure_settings()
            elif check:
                check_connection(store.engine)
                store.require_current_schema()
        except BaseException:
            store.close()  # a refused schema leaves no pooled connection behind
            raise
        return store

    @property
    def is_postgres(self) -> bool:
        """For reports and tests; code that behaves differently asks `self.dialect`."""
        return self.dialect.name == "postgresql"

    def close(self) -> None:
        """Checkpoint after writes (SQLite: the -wal file folded into the database file, so
        the file alone holds every committed row) and close every pooled connection. A checkpoint
        that fails is logged, never raised: closing must not fail a command that worked."""
        try:
            if self._wrote and not self.dialect.checkpoint(self.engine):
                log.info(
                    "the database's write-ahead log was not checkpointed: another process "
                    "is using it (it checkpoints when it stops)"
                )
        except Exception as exc:  # the driver's own errors too (a read-only file, a lock)
            log.warning("checkpoint at close failed: %s", first_line(exc))
        self.engine.dispose()

    def require_current_schema(self) -> None:
        """This version's schema, or a newer one declared compatible with it (the rule:
        storage/db/migrate.py); otherwise SchemaOutdated naming the command to run."""
        from schedctl.storage.db.migrate import require_usable_schema

        require_usable_schema(self.engine, f"the database at {redact(str(self.engine.url))}")

    @contextmanager
    def tx(self) -> Iterator[Connection]:
        """One transaction. A lost lock race (deadlock, serialization failure) becomes
        LockRace, connection loss StoreUnavailable (LockRace is one: every caller that
        waits out an outage also retries a lost race), whether the error came through
        SQLAlchemy or straight from the driver's cursor."""
        self._wrote = True
        with self._translated():
            with self.engine.begin() as connection:
                yield connection

    @contextmanager
    def read(self) -> Iterator[Connection]:
        """A transaction that only reads: on SQLite it takes no write lock (a snapshot read
        beside the one writer, under WAL); elsewhere the same as tx(). Writing in it is a
        bug (on SQLite it can fail with "database is locked" at once)."""
        with self._translated():
            with self.engine.connect() as connection:
                connection.execution_options(**{READ_ONLY_OPTION: True})
                with connection.begin():
                    yield connection

    @contextmanager
    def _translated(self) -> Iterator[None]:
        try:
            yield
        except errors.SchedError:
            raise
        except Exception as exc:
            if is_lock_race(exc):
                raise errors.LockRace(f"lock race lost, retrying: {first_line(exc)}") from exc
            if (
                isinstance(exc, OperationalError)
                or (isinstance(exc, DBAPIError) and exc.connection_invalidated)
                or _is_driver_operational_error(exc)
            ):
                raise errors.StoreUnavailable(f"database error: {first_line(exc)}") from exc
            raise

    def now(self) -> datetime:
        """The database's clock: every dispatcher agrees on "now" whatever its own clock says."""
        return self.dialect.clock(self.read)

    def clock_offset(self, samples: int = 3) -> float:
        """Seconds to add to this machine's clock to get the database's: the midpoint
        estimate of the sample with the shortest round trip (a pause or a reconnect
        during one sample would skew it by half its round trip)."""
        best: tuple[float, float] | None = None
        for _ in range(samples):
            before = time.time()
            db_now = self.now().timestamp()
            after = time.time()
            sample = (after - before, db_now - (before + after) / 2)
            if best is None or sample[0] < best[0]:
                best = sample
        assert best is not None
        return best[1]

    # -- cluster settings -------------------------------------------------------------

    def ensure_settings(self, partition_count: int = DEFAULT_PARTITION_COUNT) -> None:
        with self.tx() as connection:
            existing = connection.execute(
                select(schema.settings.c.value).where(schema.settings.c.key == "partition_count")
            ).scalar_one_or_none()
            if existing is None:
                connection.execute(
                    schema.settings.insert().values(
                        key="partition_count", value=str(partition_count)
                    )
                )

    @property
    def partition_count(self) -> int:
        if self._partition_count is None:
            try:
                with self.read() as connection:
                    value = connection.execute(
                        select(schema.settings.c.value).where(
                            schema.settings.c.key == "partition_count"
                        )
                    ).scalar_one_or_none()
            except SQLAlchemyError as exc:
                raise errors.StoreUnavailable(f"database error: {first_line(exc)}") from exc
            self._partition_count = int(value) if value else DEFAULT_PARTITION_COUNT
        return self._partition_count
