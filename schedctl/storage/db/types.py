"""Column types that behave the same on Postgres and SQLite."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import DateTime
from sqlalchemy.engine import Dialect
from sqlalchemy.types import TypeDecorator

from schedctl.storage.backend.dialect import dialect_named

# SQLAlchemy's SQLite DATETIME storage format: fixed width, so the text sorts as the instant
_STORED_FORMAT = "%04d-%02d-%02d %02d:%02d:%02d.%06d"


class UTCDateTime(TypeDecorator[datetime]):
    """An instant: timestamptz on Postgres, sortable naive-UTC text on SQLite; always aware UTC."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to a UTC column")
        value = value.astimezone(UTC)
        # SQLite compares the stored text: there every value is naive UTC in one format
        return value.replace(tzinfo=None) if dialect_named(dialect.name).naive_instants else value

    def bind_processor(self, dialect: Dialect) -> Callable[[Any], Any] | None:
        if not dialect_named(dialect.name).naive_instants:
            return super().bind_processor(dialect)

        # SQLite: one function straight to the stored text (the format of SQLAlchemy's
        # SQLite DATETIME), not this class's step and then the impl's: a claim or a
        # settle binds several instants per row, so the two steps were on the embedded
        # daemon's hot path
        def to_text(value: datetime | None) -> str | None:
            if value is None:
                return None
            if value.tzinfo is None:
                raise ValueError("naive datetime given to a UTC column")
            if value.tzinfo is not UTC:
                value = value.astimezone(UTC)
            # %-formatting the fields: cheaper than replace(tzinfo=None).isoformat()
            return _STORED_FORMAT % (
                value.year,
                value.month,
                value.day,
                value.hour,
                value.minute,
                value.second,
                value.microsecond,
            )

        return to_text

    def result_processor(self, dialect: Dialect, coltype: object) -> Callable[[Any], Any] | None:
        if not dialect_named(dialect.name).naive_instants:
            return super().result_processor(dialect, coltype)

        def from_text(value: str | datetime | None) -> datetime | None:
            if value is None:
                return None
            if isinstance(value, str):
                value = datetime.fromisoformat(value)
            return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)

        return from_text

    def process_result_value(self, value: Any, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if isinstance(value, str):
            value = datetime.fromisoformat(value)
        assert isinstance(value, datetime)
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
