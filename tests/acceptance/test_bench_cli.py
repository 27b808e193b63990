"""The shipped benchmarks run end to end at tiny sizes and report their figures (the
figures themselves are measured, never asserted)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from tests.acceptance.bench_support import bench, bench_refusal
from tests.services.zookeeper import ZooKeeperEnsemble

STAGE_KEYS = [
    f"{stage}_after_due_seconds" for stage in ("claimed", "delivered", "started", "finished")
]


def assert_whole_path(result: dict[str, Any], runs: int, *, executed: bool) -> None:
    """Every stage reported with its figures, every run through, none twice, no process in
    trouble; started and finished only where workers ran the runs."""
    assert result["runs"] == runs
    assert result["complete"] is True
    assert result["duplicates"] == 0
    assert result["missing"] == 0
    for key in STAGE_KEYS:
        assert set(result[key]) == {"last", "p50", "p99", "max", "count"}
    for key in STAGE_KEYS[:2] + (STAGE_KEYS[2:] if executed else []):
        assert result[key]["count"] == runs
        assert result[key]["p99"] >= result[key]["p50"]
    if executed:
        # per run: claimed, in the queue, started, finished, in that order (the queue's
        # sampler looks every 50 ms; a run a worker started was in the queue before)
        stages = [result[key] for key in STAGE_KEYS]
        for earlier, later in itertools.pairwise(stages):
            for figure in ("p50", "p99", "max"):
                assert earlier[figure] <= later[figure], (figure, stages)
    assert set(result["exit_codes"].values()) == {0}
    assert result["log_trouble"] == 0


def test_burst_through_the_queue_and_a_worker(sqlite_url: str) -> None:
    result = bench(
        sqlite_url, "burst", "--jobs", "200", "--lead", "2", "--workers", "1", "--timeout", "120"
    )
    assert_whole_path(result, 200, executed=True)
    assert result["missing_counted_at"] == "finished"
    assert result["peak_rss_bytes"]["worker-0"] > 0
    assert set(result["exit_codes"]) == {"dispatcher-0", "relay", "worker-0"}


def test_burst_over_http_counts_what_the_receiver_got(pg_url: str) -> None:
    result = bench(
        pg_url,
        "burst",
        "--jobs",
        "100",
        "--lead",
        "2",
        "--target",
        "http",
        "--relays",
        "2",
        "--timeout",
        "120",
    )
    assert_whole_path(result, 100, executed=False)
    assert result["missing_counted_at"] == "delivered"
    assert result["peak_rss_bytes"]["receiver"] > 0
    assert set(result["exit_codes"]) == {"dispatcher-0", "relay-0", "relay-1"}


def test_steady_through_the_queue_with_two_workers(sqlite_url: str) -> None:
    result = bench(
        sqlite_url,
        "steady",
        "--rate",
        "20",
        "--duration",
        "3",
        "--workers",
        "2",
        "--spawn-seconds",
        "1",
    )
    assert_whole_path(result, 60, executed=True)
    assert result["spawn_ceiling_per_second"] > 0
    assert result["spawn_cpu_ms_per_start"] > 0
    assert set(result["exit_codes"]) == {"dispatcher-0", "relay", "worker-0", "worker-1"}
    assert set(result["commands_cpu_seconds"]) == {"worker-0", "worker-1"}
    assert result["postgres_cpu_seconds"] is None  # SQLite: no server


def test_steady_on_postgres_reports_the_servers_cpu_per_kind_of_process(pg_url: str) -> None:
    """The server's CPU by the sessions' application_name, which each daemon mode sets:
    the Postgres side of each stage's cost per run."""
    result = bench(pg_url, "steady", "--rate", "20", "--duration", "2", "--workers", "1")
    assert_whole_path(result, 40, executed=True)
    spent = result["postgres_cpu_seconds"]
    assert {"scheduled-d dispatcher", "scheduled-d relay", "scheduled-d worker"} <= set(spent)
    assert "schedctl" in spent  # the bench's own reads
    assert all(v >= 0 for v in spent.values())
    assert set(result["postgres_cpu_seconds_per_100k_runs"]) == set(spent)
    assert set(result["commands_cpu_seconds"]) == {"worker-0"}


def test_steady_with_api_workers_executes_every_run_through_the_api(db_url: str) -> None:
    # a `scheduled-d api` process and one tenant worker over it (no database setting, the
    # bench tenant's token) are the only consumers: every run goes through the REST API
    result = bench(
        db_url, "steady", "--rate", "20", "--duration", "2", "--workers", "0", "--api-workers", "1"
    )
    assert_whole_path(result, 40, executed=True)
    assert result["exit_codes"] == {
        "dispatcher-0": 0,
        "relay": 0,
        "api-worker-0": 0,
        "api": 0,
    }


def test_steady_embedded_runs_everything_in_one_process(sqlite_url: str) -> None:
    # the embedded default: one `scheduled-d all` with a [[worker]] table running /bin/true
    result = bench(
        sqlite_url, "steady", "--rate", "20", "--duration", "3", "--workers", "1", "--embedded"
    )
    assert_whole_path(result, 60, executed=True)
    assert result["embedded"] is True
    assert result["exit_codes"] == {"all-0": 0}
    assert result["peak_rss_bytes"]["all-0"] > 0


def test_an_unknown_target_is_refused_by_name(sqlite_url: str) -> None:
    assert "target" in bench_refusal(sqlite_url, "burst", "--target", "smtp")


def test_steady_rejects_a_negative_api_worker_count(sqlite_url: str) -> None:
    assert "api_workers" in bench_refusal(sqlite_url, "steady", "--api-workers", "-1")


def test_spawn_reports_the_ceiling(sqlite_url: str) -> None:
    result = bench(sqlite_url, "spawn", "--duration", "1", "--threads", "2")
    assert result["starts_per_second"] > 0
    assert result["cpu_ms_per_start"] > 0


def test_worker_drains_its_backlog_and_reports_the_ratio_to_the_ceiling(db_url: str) -> None:
    result = bench(
        db_url, "worker", "--runs", "40", "--worker-concurrency", "8", "--spawn-seconds", "1"
    )
    assert result["complete"] is True
    assert result["succeeded"] == 40
    assert result["duplicates"] == 0
    assert result["worker_exit_code"] == 0
    assert result["log_trouble"] == 0
    assert result["started_per_second"] > 0
    assert result["spawn_ceiling_per_second"] > 0
    assert result["starts_to_ceiling"] > 0
    assert result["spawn_cpu_ms_per_start"] > 0


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


def test_console_times_each_page(sqlite_url: str) -> None:
    result = bench(sqlite_url, "console", "--jobs", "30", "--runs", "300", "--requests", "2")
    assert result["jobs"] == 30 and result["runs"] == 300 and result["dead_letters"] == 30
    pages = {page["page"]: page for page in result["pages"]}
    assert "late and failing" in pages and "cluster" in pages and len(pages) == 14
    for page in pages.values():
        assert page["status"] == 200, page
        assert page["p99_ms"] >= page["p50_ms"] > 0
