"""The dialect seam: one implementation per backend, chosen once by the Store."""

from __future__ import annotations

from pathlib import Path
from typing import get_args, get_type_hints

import pytest
from sqlalchemy.dialects import postgresql

from schedctl.storage.backend.dialect import Dialect, Lock, dialect_named, known_dialects
from schedctl.storage.db.engine import make_engine
from schedctl.storage.db.schema import jobs
from schedctl.storage.db.store import Store
from schedctl.storage.pipeline.claim_statements import queue_target


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


def test_the_seam_stays_narrow() -> None:
    # the Dialect holds what differs per backend, not each path's statements: at most 20
    # methods, none of them the benchmarks' and none typed to answer None
    methods = {
        name: value
        for name, value in vars(Dialect).items()
        if callable(value) and not name.startswith("_")
    }
    assert 0 < len(methods) <= 20, sorted(methods)
    benchmark_only = {"describe", "table_bytes", "server_sessions", "vacuum", "set_jobs_due"}
    assert not benchmark_only & set(methods)
    for name, method in methods.items():
        answer = get_type_hints(method).get("return")
        assert answer is type(None) or type(None) not in get_args(answer), name


@pytest.mark.parametrize(
    ("target_type", "target", "straight"),
    [
        ("queue", "backups", True),
        ("queue", "every:web-1", False),  # a relay decides per host at delivery
        ("http", "https://example.invalid/hook", False),
    ],
)
def test_the_claim_routes_a_run_straight_to_its_queue_by_one_rule(
    target_type: str, target: str, straight: bool
) -> None:
    assert queue_target({"target_type": target_type, "target": target}) is straight
