"""The dialect seam: one implementation per backend, chosen once by the Store."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy.dialects import postgresql

from schedctl.storage.backend.dialect import Lock, dialect_named, known_dialects
from schedctl.storage.db.engine import make_engine
from schedctl.storage.db.schema import jobs
from schedctl.storage.db.store import Store


def test_every_supported_backend_has_a_dialect() -> None:
    assert sorted(known_dialects()) == ["postgresql", "sqlite"]
    assert not dialect_named("postgresql").single_writer
    assert dialect_named("sqlite").single_writer
    with pytest.raises(ValueError, match="mysql"):
        dialect_named("mysql")


def test_the_store_chooses_its_dialect_once(tmp_path: Path) -> None:
    store = Store(make_engine(f"sqlite:///{tmp_path / 'x.db'}"))
    try:
        assert store.dialect is dialect_named("sqlite")
        assert not store.is_postgres
    finally:
        store.close()


def test_row_locks_are_postgres_only() -> None:
    query = jobs.select()
    assert dialect_named("sqlite").lock(query, Lock.share, skip_locked=True) is query
    locked = dialect_named("postgresql").lock(query, skip_locked=True)
    assert locked is not query
    assert "FOR UPDATE SKIP LOCKED" in str(locked.compile(dialect=postgresql.dialect()))
    shared = dialect_named("postgresql").lock(query, Lock.share)
    assert "FOR SHARE" in str(shared.compile(dialect=postgresql.dialect()))
    no_key = dialect_named("postgresql").lock(query, Lock.no_key_update)
    assert "FOR NO KEY UPDATE" in str(no_key.compile(dialect=postgresql.dialect()))
