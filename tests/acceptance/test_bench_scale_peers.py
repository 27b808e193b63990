"""`schedctl bench scale` and `schedctl bench peers`: their argument errors, the scale
benchmark end to end at tiny sizes on SQLite and Postgres, and the peers benchmark's parts
that need no network (the venv is made by a fake runner here; the real pip install of the
peers never runs in the suite). Figures are measured, never asserted."""

from __future__ import annotations

import json
import py_compile
import subprocess
from pathlib import Path
from typing import Any

from schedctl_bench import peers
from schedctl_bench.storage import scratch
from tests.acceptance.bench_support import bench, bench_refusal

# -- bench scale ---------------------------------------------------------------------------


def test_scale_refuses_a_compare_count_not_below_the_future_jobs(sqlite_url: str) -> None:
    assert "compare" in bench_refusal(
        sqlite_url, "scale", "--future-jobs", "100", "--compare", "100"
    )


def test_scale_refuses_zero_future_jobs(sqlite_url: str) -> None:
    assert "future_jobs" in bench_refusal(sqlite_url, "scale", "--future-jobs", "0")


def assert_levels(result: dict[str, Any], counts: list[int], burst: int) -> None:
    assert [level["future_jobs"] for level in result["levels"]] == counts
    for level in result["levels"]:
        assert level["claimed"] == burst
        assert level["dispatcher_exit"] == {"dispatcher-0": 0}
        assert level["dispatcher_peak_rss_bytes"] > 0
        assert level["due_read_burst_window"]["rows"] == burst
        assert level["due_read_empty_window"]["count"] == 2
        assert level["bytes_per_job"] > 0
        assert level["bytes_per_run_row"] > 0
    assert set(result["ratios_big_to_small"]) >= {"claims_per_second", "bytes_per_job"}


def test_scale_on_sqlite_measures_both_levels_and_the_embedded_burst(sqlite_url: str) -> None:
    result = bench(
        sqlite_url,
        "scale",
        *("--future-jobs", "300", "--compare", "100", "--burst", "40"),
        *("--reads", "2", "--lead", "3", "--timeout", "120"),
    )
    assert result["dialect"] == "sqlite"
    assert_levels(result, [100, 300], 40)
    embedded = result["embedded_burst"]
    assert embedded["complete"] is True
    assert embedded["missing"] == 0
    assert embedded["duplicates"] == 0
    assert embedded["exit_codes"] == {"all-0": 0}


def test_scale_on_postgres_loads_with_the_server_and_leaves_nothing(pg_url: str) -> None:
    result = bench(
        pg_url,
        "scale",
        *("--future-jobs", "3000", "--compare", "1000", "--burst", "40"),
        *("--reads", "2", "--lead", "3", "--timeout", "120"),
    )
    assert result["dialect"] == "postgresql"
    assert "embedded_burst" not in result
    assert_levels(result, [1000, 3000], 40)
    assert result["levels"][1]["jobs_stored"] == 3000
    from schedctl.storage.db.store import Store
    from schedctl_bench.storage import bench_sizes

    store = Store.open(pg_url)
    try:
        assert bench_sizes.row_count(store, "jobs") == 0  # without --keep
        assert bench_sizes.row_count(store, "runs") == 0
    finally:
        store.close()


def test_server_made_rows_have_the_partition_and_schedule_python_gives_them(pg_url: str) -> None:
    from datetime import timedelta

    from sqlalchemy import select

    from schedctl.scheduling.schedules import schedule_from_dict
    from schedctl.storage.db import schema
    from schedctl.storage.db.store import Store
    from schedctl.storage.jobs.job_create import partition_of
    from schedctl_bench.dispatch import bench_tenant
    from schedctl_bench.storage.bulk_future import load_future_jobs

    store = Store.open(pg_url)
    try:
        tenant_id, _ = bench_tenant(store)
        first = store.now() + timedelta(days=1)
        load_future_jobs(store, tenant_id, 50, first_at=first, spacing=timedelta(seconds=2))
        with store.read() as connection:
            rows = connection.execute(select(schema.jobs)).mappings().all()
    finally:
        store.close()
    assert len(rows) == 50
    for row in rows:
        assert row["partition"] == partition_of(row["job_id"], store.partition_count)
        schedule = schedule_from_dict(json.loads(row["schedule"]))
        assert getattr(schedule, "run_at", None) == row["next_run_at"]
        assert row["name"] == f"scale-{row['job_id']}"
    assert len({row["job_id"] for row in rows}) == 50


# -- bench peers ----------------------------------------------------------------------------


def test_peers_refuses_sqlite(sqlite_url: str, tmp_path: Path) -> None:
    assert "postgresql" in bench_refusal(sqlite_url, "peers", "--venv", str(tmp_path / "venv"))
    assert not (tmp_path / "venv").exists()


def test_peers_refuses_an_unknown_system(sqlite_url: str) -> None:
    assert "only" in bench_refusal(sqlite_url, "peers", "--only", "celery")


def test_peers_refuses_a_zero_rate(sqlite_url: str) -> None:
    assert "rate" in bench_refusal(sqlite_url, "peers", "--rate", "0")


def test_the_venv_is_made_once_with_pip_and_then_reused(tmp_path: Path) -> None:
    calls: list[list[str]] = []
    venv = tmp_path / "venv"

    def fake_run(argv: list[str], **_: Any) -> subprocess.CompletedProcess[str]:
        calls.append(argv)
        if argv[1:3] == ["-m", "venv"]:
            peers.venv_python(venv).parent.mkdir(parents=True)
            peers.venv_python(venv).write_text("")
        return subprocess.CompletedProcess(argv, 0, "", "")

    assert not peers.venv_ready(venv)
    assert peers.ensure_venv(venv, run=fake_run) == venv / "bin" / "python"
    assert [c[1:3] for c in calls] == [["-m", "venv"], ["-m", "pip"]]
    assert "--pre" in calls[1]
    assert set(peers.REQUIREMENTS) <= set(calls[1])
    assert peers.venv_ready(venv)
    peers.ensure_venv(venv, run=fake_run)
    assert len(calls) == 2  # nothing again


def test_a_failed_install_says_what_pip_said(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    peers.venv_python(venv).parent.mkdir(parents=True)
    peers.venv_python(venv).write_text("")

    def failing(argv: list[str], **_: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(argv, 1, "", "ERROR: no matching distribution")

    try:
        peers.ensure_venv(venv, run=failing)
    except Exception as exc:
        assert "no matching distribution" in str(exc)
    else:
        raise AssertionError("a failed pip install must raise")
    assert not peers.venv_ready(venv)


def test_peer_scripts_compile_and_take_the_workload(tmp_path: Path) -> None:
    for script in sorted(peers.SCRIPTS.glob("*.py")):
        py_compile.compile(str(script), cfile=str(tmp_path / f"{script.stem}.pyc"), doraise=True)
    w = peers.Workloads(jobs=5, rate=2, duration=3.0)
    dsn = scratch.libpq_dsn("postgresql+psycopg://postgres:pw@127.0.0.1:5544/bench")
    assert dsn == "host=127.0.0.1 port=5544 user=postgres dbname=bench password=pw"
    for system in peers.PEERS:
        argv = peers.peer_argv(Path("/venv/bin/python"), system, dsn, "steady", w, tmp_path)
        assert Path(argv[1]).is_file()
        assert argv[argv.index("--rate") + 1] == "2"
        assert argv[argv.index("--dsn") + 1] == dsn
    assert w.total("burst") == 5 and w.total("steady") == 6


def test_peer_figures_and_ratios_come_from_the_pairs() -> None:
    result = {
        "jobs": 4,
        "pairs": [[100.0, 100.5], [100.0, 101.0], [100.0, 101.5]],
        "version": "9",
        "complete": False,
    }
    f = peers.peer_figures(result)
    assert (f["started"], f["of"], f["last_s"], f["p50_s"]) == (3, 4, 1.5, 1.0)
    ratios = peers.ratios(
        {"scheduled-d": {"last_s": 0.5, "p50_s": 0.25, "p99_s": 0.0}, "procrastinate": f}
    )
    assert ratios == {"procrastinate": {"last": 3.0, "p50": 4.0, "p99": None, "lower_bound": False}}
    done = {"last_s": 0.5, "p50_s": 0.25, "p99_s": 0.5, "complete": True}
    assert peers.ratios({"scheduled-d": done, "apscheduler": f})["apscheduler"]["lower_bound"]


def test_peers_with_scheduled_d_only_needs_no_venv(pg_url: str, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    result = bench(
        pg_url,
        "peers",
        *("--only", "scheduled-d", "--jobs", "30", "--rate", "10", "--duration", "2"),
        *("--lead", "5", "--timeout", "120", "--venv", str(venv)),
    )
    assert not venv.exists()
    for workload, runs in (("burst", 30), ("steady", 20)):
        figures = result[workload]["scheduled-d"]
        assert figures["started"] == figures["of"] == runs
        assert figures["complete"] is True
        assert figures["error"] is None
        assert result[f"{workload}_ratio_to_scheduled_d"] == {}
    assert set(result["started_means"]) == {"scheduled-d"}
