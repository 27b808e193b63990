"""Owns the tests of a job's run policy (schedctl.domain.runpolicy) through the job body, the
job update, the job files and the crontab import: pure, no database."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from schedctl.app import crontab
from schedctl.core import errors
from schedctl.domain import jobpatch
from schedctl.domain.jobfiles import JobFilesError, parse_text
from schedctl.domain.jobspec import parse_job_request
from schedctl.domain.runpolicy import Overlap, RunPolicy

NOW = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
QUEUE = {"type": "queue", "name": "q"}
HTTP = {"type": "http", "url": "https://example.com/hook"}


def _body(**extra: Any) -> dict[str, Any]:
    return {"schedule": {"every": "1m"}, "target": dict(QUEUE), **extra}


def _refused(body: dict[str, Any]) -> errors.ValidationError:
    with pytest.raises(errors.ValidationError) as caught:
        parse_job_request(body, now=NOW)
    return caught.value


def test_the_default_is_queue_without_limits() -> None:
    assert parse_job_request(_body(), now=NOW).run == RunPolicy()
    assert RunPolicy().overlap is Overlap.QUEUE


@pytest.mark.parametrize("value", ["allow", "skip", "queue", "replace"])
def test_every_overlap_value_is_taken(value: str) -> None:
    assert parse_job_request(_body(overlap=value), now=NOW).run.overlap.value == value


@pytest.mark.parametrize("value", ["forbid", "", "SKIP", None, 1, ["skip"]])
def test_a_bad_overlap_names_the_field(value: Any) -> None:
    error = _refused(_body(overlap=value))
    assert error.field == "overlap"
    assert "allow, skip, queue, replace" in str(error)


def test_overlap_other_than_queue_is_refused_for_http_targets() -> None:
    error = _refused({"schedule": {"every": "1m"}, "target": dict(HTTP), "overlap": "skip"})
    assert error.field == "overlap" and "queue targets" in str(error)
    spec = parse_job_request({"schedule": {"every": "1m"}, "target": HTTP, "overlap": "queue"},
                             now=NOW)  # fmt: skip
    assert spec.run.overlap is Overlap.QUEUE
    error = _refused({"schedule": {"every": "1m"}, "target": dict(HTTP), "tasks_max": 5})
    assert error.field == "tasks_max"


@pytest.mark.parametrize(
    ("value", "size"),
    [("512M", 512 << 20), ("2G", 2 << 30), ("1GiB", 1 << 30), (1 << 20, 1 << 20), (None, None)],
)
def test_memory_sizes(value: Any, size: int | None) -> None:
    assert parse_job_request(_body(memory_max=value), now=NOW).run.memory_max == size


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("memory_max", "12X"),
        ("memory_max", 100),  # bytes: under a MiB is a typo
        ("memory_max", True),
        ("memory_max", "-1M"),
        ("cpu_weight", 0),
        ("cpu_weight", 10_001),
        ("cpu_weight", "100"),
        ("tasks_max", 0),
        ("tasks_max", 1.5),
    ],
)
def test_bad_limits_name_their_field(key: str, value: Any) -> None:
    assert _refused(_body(**{key: value})).field == key


def test_an_update_keeps_what_it_does_not_name_and_checks_the_new_target() -> None:
    job = _central(overlap="skip", tasks_max=10)
    patch = jobpatch.parse_job_patch({"cpu_weight": 50}, job, now=NOW)
    assert patch.run == RunPolicy(Overlap.SKIP, None, 50, 10)
    with pytest.raises(errors.ValidationError) as caught:
        jobpatch.parse_job_patch({"target": dict(HTTP)}, job, now=NOW)
    assert caught.value.field == "overlap"
    with pytest.raises(errors.ValidationError) as caught:
        jobpatch.parse_job_patch({"overlap": "sometimes"}, job, now=NOW)
    assert caught.value.field == "overlap"
    assert jobpatch.parse_job_patch({"name": "x"}, job, now=NOW).run is None


def _central(**run: Any) -> Any:
    from schedctl.domain.models import Job, JobStatus

    spec = parse_job_request(_body(**run), now=NOW)
    return Job(
        job_id="j1", tenant_id="t", name="j", schedule=spec.schedule, target=spec.target,
        payload={}, retry=spec.retry, misfire_policy=spec.misfire_policy, grace_seconds=60,
        window_seconds=0, max_concurrency=1, timeout_seconds=0, start_at=None, end_at=None,
        status=JobStatus.active, next_run_at=None, next_fire_at=None, partition=0, version=1,
        idempotency_key=None, created_at=NOW, updated_at=NOW, run=spec.run,
    )  # fmt: skip


def test_job_files_carry_the_run_policy_to_the_central_body() -> None:
    text = (
        '[[job]]\nname = "j"\ncron = "* * * * *"\ncommand = ["/x"]\n'
        'overlap = "replace"\nmemory_max = "256M"\ncpu_weight = 20\ntasks_max = 32\n'
    )
    body = parse_text(text, "x.toml").jobs[0].job_body("q")
    spec = parse_job_request(body, now=NOW)
    assert spec.run == RunPolicy(Overlap.REPLACE, 256 << 20, 20, 32)


def test_a_bad_overlap_in_a_job_file_names_file_line_and_key() -> None:
    text = '[[job]]\nname = "j"\ncron = "* * * * *"\ncommand = ["/x"]\noverlap = "never"\n'
    with pytest.raises(JobFilesError) as caught:
        parse_text(text, "x.toml")
    (problem,) = caught.value.problems
    assert (problem.key, problem.line) == ("job.overlap", 5)


def test_imported_crontab_lines_overlap_as_cron_runs_them() -> None:
    result = crontab.convert("*/5 * * * * /usr/bin/check\n", user="alice", timezone="UTC")
    (job,) = result.jobs
    assert job["overlap"] == "allow"
