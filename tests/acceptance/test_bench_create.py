"""Owns the tests of `schedctl bench create`: its modes run end to end at tiny sizes with
every job created and no request lost, and its client sends a request again, once, on a
fresh connection when the server closed the idle keep-alive one (figures never asserted)."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator

import pytest
from sqlalchemy import text

from schedctl.storage.db.engine import make_engine
from schedctl_bench.create import _Client
from tests.acceptance.bench_support import bench


@pytest.mark.parametrize(
    "mode",
    [[], ["--batch", "--batch-size", "7"], ["--batch", "--minimal"], ["--import"]],
    ids=["single", "batch", "batch-minimal", "import"],
)
def test_every_job_is_created_and_no_request_lost(sqlite_url: str, mode: list[str]) -> None:
    result = bench(sqlite_url, "create", "--jobs", "30", "--concurrency", "2", *mode)
    minimal = "--minimal" in mode or "--import" in mode
    assert result["answers"] == ("minimal" if minimal else "whole jobs")
    assert result["created"] == 30
    assert result["failures"] == {}
    assert result["refused"] == {}
    assert result["api_cpu_ms_per_job"] is not None


class _ClosingHandler(http.server.BaseHTTPRequestHandler):
    """Answers a POST, then closes the connection without saying so (no Connection:
    close), as a server does whose keep-alive timeout ran out while the client was idle."""

    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        body = b'{"ok": true}'
        self.send_response(201)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        self.close_connection = True

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def closing_server() -> Iterator[tuple[str, int]]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ClosingHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield "127.0.0.1", server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def test_a_request_on_a_closed_keep_alive_connection_is_sent_again(
    closing_server: tuple[str, int],
) -> None:
    client = _Client(*closing_server, token="t")
    try:
        for _ in range(3):  # each after the server closed the connection the last one used
            status, data = client.post("/v1/jobs", {"idempotency_key": "k"})
            assert (status, data) == (201, {"ok": True})
        assert client.stale_retries == 2
    finally:
        client.close()


@pytest.mark.postgres
def test_a_run_starts_from_jobs_vacuumed_and_analyzed(pg_url: str) -> None:
    """A former run's deleted jobs are vacuumed away and the statistics made current before
    the clients start: autovacuum otherwise counted the table empty while the run filled
    it, and Postgres walked every job of the tenant for each key until its next analyze
    (imports of 150,000 jobs in 76-82 s instead of 15)."""
    result = bench(pg_url, "create", "--jobs", "5", "--concurrency", "1")
    assert result["created"] == 5
    engine = make_engine(pg_url)
    try:
        with engine.connect() as connection:
            done = connection.execute(
                text(
                    "SELECT relname, last_vacuum IS NOT NULL AND last_analyze IS NOT NULL"
                    " FROM pg_stat_user_tables WHERE relname IN ('jobs', 'audit_log')"
                )
            ).all()
    finally:
        engine.dispose()
    assert sorted(done) == [("audit_log", True), ("jobs", True)], done
