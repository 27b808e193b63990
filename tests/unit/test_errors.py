"""Owns the tests of the one table of error codes (schedctl.core.errors): every class has its code,
exit code and HTTP status; the API answers each with them; the API client and the queue
client read them back to the same class; the CLI's exit-code help comes from them."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest
import requests
from fastapi import FastAPI

from schedctl.app.service import Scheduler
from schedctl.cli.common import EXIT_CODES_HELP
from schedctl.clients import client, queue_client
from schedctl.core import errors
from scheduled_d.api import create_app


def _call(app: FastAPI, method: str, path: str) -> requests.Response:
    """One request through the app's ASGI interface (no socket), as a requests.Response."""
    messages: list[dict[str, object]] = []

    async def receive() -> dict[str, object]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, object]) -> None:
        messages.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"127.0.0.1")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    asyncio.run(app(scope, receive, send))  # type: ignore[arg-type]
    start = next(m for m in messages if m["type"] == "http.response.start")
    body = b"".join(
        bytes(m.get("body", b""))
        for m in messages
        if m["type"] == "http.response.body"  # type: ignore[call-overload]
    )
    raw = start["headers"]
    assert isinstance(raw, list)
    headers = {bytes(k).decode(): bytes(v).decode() for k, v in raw}
    return _response(int(start["status"]), json.loads(body), headers)  # type: ignore[call-overload]


def _response(
    status: int, body: object, headers: dict[str, str] | None = None
) -> requests.Response:
    """A requests.Response as the HTTP layer would hand it to the clients."""
    response = requests.Response()
    response.status_code = status
    response._content = json.dumps(body).encode()
    response.headers.update({"Content-Type": "application/json", **(headers or {})})
    response.url = "http://127.0.0.1:1/v1/test"
    response.reason = "test"
    return response


@pytest.mark.parametrize("kind", errors.ERROR_CLASSES, ids=lambda k: k.__name__)
def test_every_error_class_has_its_code_exit_code_and_status(kind: type[errors.SchedError]) -> None:
    assert "code" in vars(kind), f"{kind.__name__} shares its parent's code"
    assert isinstance(kind.code, str) and kind.code
    assert isinstance(kind.exit_code, int) and 1 <= kind.exit_code <= 125
    assert isinstance(kind.http_status, int) and 400 <= kind.http_status <= 599
    assert errors.from_code(kind.code) is kind
    # a status leads back to a class answering with it (the client's fallback without a code)
    general = errors.from_status(kind.http_status)
    assert general is not None and general.http_status == kind.http_status


def test_codes_are_unique_and_unknown_ones_are_none() -> None:
    codes = [kind.code for kind in errors.ERROR_CLASSES]
    assert len(codes) == len(set(codes))
    assert errors.from_code("no_such_code") is None
    assert errors.from_status(418) is None


@pytest.mark.parametrize("kind", errors.ERROR_CLASSES, ids=lambda k: k.__name__)
def test_the_client_maps_every_api_error_code_back_to_its_class(
    kind: type[errors.SchedError],
) -> None:
    body = {"error": {"code": kind.code, "message": "it went wrong", "field": "f"}}
    rebuilt = client._error(_response(kind.http_status, body))
    assert type(rebuilt) is kind
    assert rebuilt.field == "f"
    assert rebuilt.exit_code == kind.exit_code


def test_the_client_falls_back_on_the_status_and_keeps_retry_after() -> None:
    odd = {"error": {"code": "http_error", "message": "teapot", "field": None}}
    assert type(client._error(_response(405, odd))) is errors.MethodNotAllowed
    assert type(client._error(_response(418, odd))) is errors.SchedError
    not_json = _response(503, None)
    not_json._content = b"<html>"
    assert type(client._error(not_json)) is errors.StoreUnavailable
    quota = {"error": {"code": "quota_exceeded", "message": "slow down", "field": "max_jobs"}}
    rebuilt = client._error(_response(429, quota, {"Retry-After": "7"}))
    assert isinstance(rebuilt, errors.QuotaExceeded) and rebuilt.retry_after == 7
    rebuilt = client._error(_response(429, quota))
    assert isinstance(rebuilt, errors.QuotaExceeded)
    assert rebuilt.retry_after == errors.QuotaExceeded.DEFAULT_RETRY_AFTER_SECONDS


def test_the_api_answers_every_class_with_its_status_and_code_and_the_client_agrees() -> None:
    # the app is built without a database: these routes never reach one
    app = create_app(object.__new__(Scheduler), max_request_bytes=1 << 20)

    def boom(code: str) -> None:
        kind = errors.from_code(code)
        assert kind is not None
        raise kind("it went wrong", field="f")

    app.add_api_route("/boom/{code}", boom, methods=["GET"])
    for kind in errors.ERROR_CLASSES:
        answer = _call(app, "GET", f"/boom/{kind.code}")
        assert answer.status_code == kind.http_status, kind.__name__
        assert answer.json()["error"]["code"] == kind.code
        assert type(client._error(answer)) is kind
    # Starlette's own errors take their codes from the same table
    assert _call(app, "GET", "/no/such/route").json()["error"]["code"] == errors.NotFound.code
    not_allowed = _call(app, "PUT", "/v1/tenant").json()["error"]["code"]
    assert not_allowed == errors.MethodNotAllowed.code


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (500, errors.StoreUnavailable),
        (503, errors.StoreUnavailable),
        (429, errors.StoreUnavailable),
        (401, errors.Unauthorized),
        (404, errors.NotFound),
        (409, errors.ValidationError),
        (422, errors.ValidationError),
        (400, errors.ValidationError),
    ],
)
def test_the_queue_client_retries_what_is_transient(
    status: int, kind: type[errors.SchedError]
) -> None:
    body = {"error": {"code": "x", "message": "no", "field": None}}
    assert type(queue_client._error(_response(status, body))) is kind


def test_the_cli_exit_codes_help_comes_from_the_classes() -> None:
    assert EXIT_CODES_HELP == (
        "Exit codes: 0 ok, 1 internal error, 2 invalid input or usage, 3 not found, "
        "4 conflict, 5 quota exceeded, 6 unauthorized, 7 database unavailable, "
        "141 output pipe closed (as `head` does)."
    )
    for code, meaning in errors.exit_codes().items():
        assert f"{code} {meaning}" in EXIT_CODES_HELP


def test_the_client_does_not_load_the_service() -> None:
    # `schedctl --api` talks HTTP: it needs schedctl.core.errors, not the database layer's service
    loaded = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, schedctl.clients.client, schedctl.clients.queue_client; "
            "print('schedctl.app.service' in sys.modules)",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert loaded.stdout.strip() == "False"


def test_quota_exceeded_retry_after_is_at_least_one_second() -> None:
    assert errors.QuotaExceeded("x", retry_after=0).retry_after == 1
    assert errors.QuotaExceeded("x").retry_after == errors.QuotaExceeded.DEFAULT_RETRY_AFTER_SECONDS
