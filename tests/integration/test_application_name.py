"""Owns the test that every session a process opens on Postgres says who it is
(application_name): a scheduled-d mode, or schedctl, unless the URL names itself."""

from __future__ import annotations

import pytest
from sqlalchemy import text

from schedctl.storage.db.store import Store

pytestmark = pytest.mark.postgres


def _name(store: Store) -> str:
    try:
        with store.read() as connection:
            return str(connection.execute(text("SHOW application_name")).scalar_one())
    finally:
        store.close()


def test_sessions_carry_the_process_role(pg_url: str) -> None:
    assert _name(Store.open(pg_url)) == "schedctl"
    assert _name(Store.open(pg_url, application_name="scheduled-d worker")) == (
        "scheduled-d worker"
    )


def test_a_name_in_the_url_wins(pg_url: str) -> None:
    separator = "&" if "?" in pg_url else "?"
    url = f"{pg_url}{separator}application_name=billing-scheduler"
    assert _name(Store.open(url, application_name="scheduled-d worker")) == "billing-scheduler"
