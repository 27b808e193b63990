"""Owns the API tests' client side: a tenant's view of the API (`Api`, requests with its
bearer token), a request body, a served API (`serving`), and the table snapshot that shows a
refused request changed nothing. The `server`, `acme` and `other` fixtures over these are in
tests/integration/conftest.py."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import requests

from schedctl.app.service import Scheduler
from schedctl.storage.db import schema
from schedctl.storage.db.store import Store
from scheduled_d.api.server import ApiServer
from tests.integration.queue_support import table_snapshot

QUEUE = {"type": "queue", "name": "digest-jobs"}
MARKER = "PAYLOAD-MARKER-5c1e9d"
SNAPSHOT_TABLES = (schema.jobs, schema.runs, schema.outbox, schema.audit_log, schema.api_tokens)


def job_body(**overrides: Any) -> dict[str, Any]:
    return {"schedule": {"cron": "0 8 * * MON"}, "target": dict(QUEUE), **overrides}


class Api:
    """One tenant's view of the API: requests with its bearer token."""

    def __init__(self, base_url: str, token: str) -> None:
        self.base_url = base_url
        self.token = token
        self.token_id = token.split("_")[1]
        self.session = requests.Session()
        self.session.headers["Authorization"] = f"Bearer {token}"

    def request(self, method: str, path: str, **kwargs: Any) -> requests.Response:
        return self.session.request(method, self.base_url + path, timeout=30, **kwargs)

    def create(self, body: dict[str, Any] | None = None, **headers: str) -> requests.Response:
        return self.request("POST", "/v1/jobs", json=body or job_body(), headers=headers)

    def new_job(self, body: dict[str, Any] | None = None) -> dict[str, Any]:
        response = self.create(body)
        assert response.status_code == 201, response.text
        data: dict[str, Any] = response.json()
        return data


@contextmanager
def serving(sched: Scheduler, **kwargs: Any) -> Iterator[ApiServer]:
    server = ApiServer(sched, "127.0.0.1:0", access_log=kwargs.pop("access_log", False), **kwargs)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def snapshot(store: Store) -> dict[str, list[tuple[Any, ...]]]:
    return table_snapshot(store, SNAPSHOT_TABLES)
