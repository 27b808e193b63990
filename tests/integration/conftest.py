"""Owns the integration tests' shared store fixtures: `store`, an open Store over the test's
fresh database (``db_url``: SQLite and Postgres), `pg_store`, one over Postgres only, and
`sched`, a Scheduler (the service layer) over the test's fresh database; the API tests'
`server` (the API served on loopback over `sched`), `acme` and `other` (two tenants' clients,
tests/integration/api_support.py), and `keys`, two payload keys with the process cipher reset
around the test.

A module that needs more in its store (a tenant, settings) overrides `store` by a fixture of
the same name that takes this one, adds what it needs and returns it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import closing

import pytest

from schedctl.app.service import Scheduler
from schedctl.core.crypto import KEYS_ENV, KEYS_FILE_ENV, PayloadCipher
from schedctl.storage.db.store import Store
from schedctl.storage.jobs.payloads import reset_payload_cipher
from scheduled_d.api.server import ApiServer
from tests.integration.api_support import Api, serving


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    with closing(Store.open(db_url)) as store:
        yield store


@pytest.fixture
def sched(db_url: str) -> Iterator[Scheduler]:
    with Scheduler.open(db_url) as scheduler:
        yield scheduler


@pytest.fixture
def pg_store(pg_url: str) -> Iterator[Store]:
    with closing(Store.open(pg_url)) as store:
        yield store


@pytest.fixture
def server(sched: Scheduler) -> Iterator[ApiServer]:
    with serving(sched) as running:
        yield running


@pytest.fixture
def acme(sched: Scheduler, server: ApiServer) -> Api:
    _, token = sched.create_tenant("acme", "test")
    return Api(server.url, token)


@pytest.fixture
def other(sched: Scheduler, server: ApiServer) -> Api:
    _, token = sched.create_tenant("other", "test")
    return Api(server.url, token)


@pytest.fixture
def keys(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, str]]:
    """Two payload keys; the process cipher is reset around the test."""
    monkeypatch.delenv(KEYS_ENV, raising=False)
    monkeypatch.delenv(KEYS_FILE_ENV, raising=False)
    reset_payload_cipher()
    try:
        yield PayloadCipher.generate_key(), PayloadCipher.generate_key()
    finally:
        reset_payload_cipher()
