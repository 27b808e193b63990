"""Owns the integration tests' shared store fixtures: `store`, an open Store over the test's
fresh database (``db_url``: SQLite and Postgres), `pg_store`, one over Postgres only, and
`sched`, a Scheduler (the service layer) over the test's fresh database.

A module that needs more in its store (a tenant, settings) overrides `store` by a fixture of
the same name that takes this one, adds what it needs and returns it.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from schedctl.service import Scheduler
from schedctl.storage.store import Store


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    store = Store.open(db_url)
    yield store
    store.close()


@pytest.fixture
def sched(db_url: str) -> Iterator[Scheduler]:
    scheduler = Scheduler.open(db_url)
    try:
        yield scheduler
    finally:
        scheduler.close()


@pytest.fixture
def pg_store(pg_url: str) -> Iterator[Store]:
    store = Store.open(pg_url)
    yield store
    store.close()
