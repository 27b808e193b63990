"""The shipped benchmarks run end to end at tiny sizes and report their figures (the
figures themselves are measured, never asserted)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from typer.testing import CliRunner

from schedctl.cli.app import app
from tests.services.zookeeper import ZooKeeperEnsemble

runner = CliRunner()


def bench(db: str, *args: str) -> Any:
    result = runner.invoke(app, ["--db", db, "-o", "json", "bench", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_burst_claims_every_run(sqlite_url: str) -> None:
    result = bench(sqlite_url, "burst", "--jobs", "200", "--lead", "2", "--timeout", "60")
    assert result["claimed"] == result["jobs"] == 200
    assert result["all_claimed_after_due_seconds"] is not None


def test_steady_reports_lateness_percentiles(sqlite_url: str) -> None:
    result = bench(sqlite_url, "steady", "--rate", "20", "--duration", "2", "--workers", "2")
    assert result["claimed"] == result["runs"] == 40
    assert result["lateness_p99_seconds"] >= result["lateness_p50_seconds"]
    # workers consumed the queue meanwhile: every run executed, nothing escaped a loop
    assert result["executed"] == 40
    assert result["start_lateness_p99_seconds"] >= result["start_lateness_p50_seconds"]
    assert result["consumer_exit_codes"] == {"relay": 0, "worker-0": 0, "worker-1": 0}
    assert result["consumer_log_trouble"] == 0


def test_steady_with_api_workers_executes_every_run_through_the_api(db_url: str) -> None:
    # a `scheduled-d api` process and one tenant worker over it (no database setting, the
    # bench tenant's token) are the only consumers: every run goes through the REST API
    result = bench(
        db_url, "steady", "--rate", "20", "--duration", "2", "--workers", "0", "--api-workers", "1"
    )
    assert result["claimed"] == result["runs"] == 40
    assert result["executed"] == result["executed_by_api_workers"] == 40
    assert result["executed_by_direct_workers"] == 0
    assert result["api_start_lateness_p99_seconds"] >= result["api_start_lateness_p50_seconds"]
    assert result["consumer_exit_codes"] == {"relay": 0, "api-worker-0": 0, "api": 0}
    assert result["consumer_log_trouble"] == 0


def test_steady_rejects_a_negative_api_worker_count(sqlite_url: str) -> None:
    result = runner.invoke(app, ["--db", sqlite_url, "bench", "steady", "--api-workers", "-1"])
    assert result.exit_code == 2
    assert "--api-workers" in result.output


def test_delivery_reports_http_and_queue_rates(sqlite_url: str) -> None:
    result = bench(sqlite_url, "delivery", "--runs", "50", "--timeout", "120")
    assert result["http_received"] == 50
    assert result["http_deliveries_per_second"] > 0
    assert result["queue_deliveries_per_second"] > 0


def test_api_reports_throughput_and_latency(sqlite_url: str) -> None:
    result = bench(sqlite_url, "api", "-n", "30", "-c", "2")
    assert result["jobs_per_s"] > 0
    assert result["p99_ms"] >= result["p50_ms"] > 0


@pytest.mark.zookeeper
def test_failover_reports_recovery_times(pg_url: str, zk_ensemble: ZooKeeperEnsemble) -> None:
    result = bench(pg_url, "failover", "--zookeeper", zk_ensemble.hosts, "--session-timeout", "2")
    assert result["epochs_increased"] is True
    for key in ("reown_after_kill9_seconds", "reown_after_sigstop_seconds"):
        assert result[key] > 0
    assert result["reown_after_sigterm_seconds"] >= 0
