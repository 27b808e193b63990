"""Owns the tests that every libpq multi-host URL form reaches the writable server, in the
pool, in the LISTEN connections (jobs and ready-work feeds) and in the CLI, with
target_session_attrs=read-write, and that the LISTEN sessions carry the process's
application_name. The first host of each URL is a closed loopback port, so only a client
that tries every host in order gets through; with a Postgres standby in its place
(tests/chaos/test_patroni.py) the same URLs follow the primary."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import closing

import pytest
from sqlalchemy import text
from typer.testing import CliRunner

from schedctl.cli.app import app
from schedctl.storage.db.engine import normalize_url
from schedctl.storage.db.store import Store
from tests.services.ports import free_port

pytestmark = pytest.mark.postgres

# (form, URL of hosts [(host, port), ...] and database)
FORMS: dict[str, Callable[[list[tuple[str, int]], str], str]] = {
    # SQLAlchemy's documented form
    "repeated host": lambda hosts, db: (
        f"postgresql://postgres@/{db}?"
        + "&".join(f"host={h}:{p}" for h, p in hosts)
        + "&target_session_attrs=read-write"
    ),
    # libpq's comma lists in the query
    "comma lists": lambda hosts, db: (
        f"postgresql://postgres@/{db}?host={','.join(h for h, _ in hosts)}"
        f"&port={','.join(str(p) for _, p in hosts)}&target_session_attrs=read-write"
    ),
    # libpq's own URL, hosts in the authority (SQLAlchemy cannot parse it as it is)
    "libpq URL": lambda hosts, db: (
        f"postgresql://postgres@{','.join(f'{h}:{p}' for h, p in hosts)}/{db}"
        "?target_session_attrs=read-write"
    ),
    # libpq's key=value connection string
    "key=value": lambda hosts, db: (
        f"host={','.join(h for h, _ in hosts)} port={','.join(str(p) for _, p in hosts)} "
        f"dbname={db} user=postgres target_session_attrs=read-write"
    ),
}


def multi_host_url(form: str, pg_url: str) -> str:
    """`pg_url`'s database behind a closed port, in `form`."""
    from sqlalchemy.engine import make_url

    url = make_url(pg_url)
    assert url.host is not None and url.port is not None and url.database is not None
    return FORMS[form]([("127.0.0.1", free_port()), (url.host, url.port)], url.database)


def _listening_names(store: Store) -> list[str]:
    with store.read() as connection:
        return [
            str(name)
            for (name,) in connection.execute(
                text(
                    "SELECT application_name FROM pg_stat_activity "
                    "WHERE datname = current_database() AND query LIKE 'LISTEN%'"
                )
            )
        ]


@pytest.mark.parametrize("form", sorted(FORMS))
def test_every_form_reaches_the_server_in_the_pool_and_the_listeners(
    pg_url: str, form: str
) -> None:
    url = multi_host_url(form, pg_url)
    with closing(Store.open(url, application_name="scheduled-d all")) as store:
        with store.read() as connection:
            assert connection.execute(text("SHOW application_name")).scalar_one() == (
                "scheduled-d all"
            )
        jobs = store.dialect.change_feed(store.engine, 0.25)
        ready = store.dialect.ready_feed(store.engine, "word")
        assert ready is not None
        try:
            # the first wait connects (and asks for a reload / a look); then a word is heard
            assert jobs.wait(1.0).reload
            assert ready.wait(1.0)
            assert _listening_names(store) == ["scheduled-d all", "scheduled-d all"]
            with store.tx() as connection:
                store.dialect.notify_job_changes(connection, [("job-1", 0)])
                store.dialect.notify_ready(connection, ["word"])
            heard: set[str] = set()
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not ("job-1" in heard and "ready" in heard):
                heard.update(jobs.wait(0.5).job_ids)
                if ready.wait(0.5):
                    heard.add("ready")
            assert heard >= {"job-1", "ready"}
        finally:
            jobs.close()
            ready.close()


@pytest.mark.parametrize("form", sorted(FORMS))
def test_the_cli_takes_every_form(pg_url: str, form: str) -> None:
    url = multi_host_url(form, pg_url)
    result = CliRunner().invoke(app, ["--db", url, "db", "status"])
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output


def test_the_forms_normalize_to_what_sqlalchemy_parses() -> None:
    assert normalize_url("postgresql://u:p%40w@h1:1,h2:2/db?sslmode=require") == (
        "postgresql+psycopg://u:p%40w@/db?host=h1,h2&port=1,2&sslmode=require"
    )
    assert normalize_url("postgres://h1,[::1]:2") == "postgresql+psycopg:///?host=h1,::1&port=,2"
    assert normalize_url("host=h1,h2 port=1,2 dbname=db user=u password=p@x") == (
        "postgresql+psycopg://u:p%40x@/db?host=h1,h2&port=1,2"
    )
    # one host, or SQLAlchemy's own repeated form: unchanged but for the driver
    assert normalize_url("postgresql://u@h:1/db?host=a:1&host=b:2") == (
        "postgresql+psycopg://u@h:1/db?host=a:1&host=b:2"
    )


def test_a_malformed_key_value_string_names_the_field() -> None:
    from schedctl.core import errors

    with pytest.raises(errors.ConfigError) as raised:
        normalize_url("host='h1 port=1")
    assert raised.value.field == "database_url"
    assert "h1" not in str(raised.value)
