"""A database the API cannot reach: /healthz and every 503 body say "database unavailable"
and nothing about where the database is (host, port, driver message), to callers with or
without a token; the operator finds the details in the log, and the CLI's own error keeps
them. Real uvicorn, a real psycopg engine aimed at a closed loopback port (or at a name
that does not resolve): nothing is mocked."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import requests

from schedctl.app.service import Scheduler
from schedctl.core import errors
from schedctl.storage.db.engine import check_connection
from schedctl.storage.db.store import Store
from scheduled_d.api.server import ApiServer
from tests.services.ports import free_port

SECRET_PASSWORD = "hunter2-db-password"


def down_url(host: str, port: int) -> str:
    return f"postgresql+psycopg://sched:{SECRET_PASSWORD}@{host}:{port}/scheduled"


@pytest.fixture(params=["closed-port", "unresolvable-host"])
def down(request: pytest.FixtureRequest) -> Iterator[tuple[ApiServer, list[str]]]:
    """An API server over a store whose database is not there, and the words a body must
    not contain."""
    if request.param == "closed-port":
        port = free_port()  # nothing listens: connect() is refused at once
        host = "127.0.0.1"
    else:
        port, host = 5432, "scheduled-db.invalid"  # .invalid never resolves (RFC 6761)
    store = Store.open(down_url(host, port), check=False)
    server = ApiServer(Scheduler(store), "127.0.0.1:0", access_log=False)
    server.start()
    try:
        yield server, [host, str(port), SECRET_PASSWORD, "sched@", "psycopg", "connection"]
    finally:
        server.stop()
        store.close()


def assert_says_only_unavailable(response: requests.Response, forbidden: list[str]) -> None:
    assert response.status_code == 503, response.text
    assert response.json() == {
        "error": {"code": "unavailable", "message": "database unavailable", "field": None}
    }
    for word in forbidden:
        assert word not in response.text, word
        for name, value in response.headers.items():
            assert word not in value, (name, word)


def test_healthz_and_503_bodies_never_say_where_the_database_is(
    down: tuple[ApiServer, list[str]], caplog: pytest.LogCaptureFixture
) -> None:
    server, forbidden = down
    caplog.set_level(logging.INFO)
    # no token needed, and none given
    assert_says_only_unavailable(requests.get(server.url + "/healthz", timeout=30), forbidden)
    # a caller with a token (checked against the database, which is not there)
    for method, path in (("GET", "/v1/jobs"), ("GET", "/v1/tenant"), ("POST", "/v1/jobs")):
        response = requests.request(
            method,
            server.url + path,
            headers={"Authorization": "Bearer st_abcdefabcdef_0123456789abcdef0123456789"},
            json={"schedule": {"delay": "PT1M"}, "target": {"type": "queue", "name": "q"}},
            timeout=30,
        )
        assert_says_only_unavailable(response, forbidden)
    # the operator's log has what the body left out (but never the password)
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "database" in logged and forbidden[0] in logged
    assert SECRET_PASSWORD not in logged


def test_the_operators_own_error_keeps_the_details() -> None:
    port = free_port()
    store = Store.open(down_url("127.0.0.1", port), check=False)
    try:
        with pytest.raises(errors.StoreUnavailable) as caught:
            check_connection(store.engine)
    finally:
        store.close()
    # the CLI prints str(error) and exits 7: where the database is helps the operator
    assert "127.0.0.1" in str(caught.value) and str(port) in str(caught.value)
    assert SECRET_PASSWORD not in str(caught.value)
    assert caught.value.exit_code == 7
    # an HTTP body gets only the public message
    assert caught.value.public_message == "database unavailable"
    assert errors.NotFound("no job 'x'").public_message == "no job 'x'"
