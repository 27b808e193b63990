"""Where a job file's job lives centrally, per host: names and queues."""

from __future__ import annotations

import pytest

from schedctl.core import errors
from schedctl.domain.jobfiles import FileJob, parse_text
from schedctl.domain.jobfiles import placement as pl
from tests.jobfile_texts import true_jobs

TEXT = true_jobs(
    ("backup", 'cron = "0 3 * * *"', None),
    ("report", 'cron = "0 4 * * *"', "host-group:batch"),
    ("rotate", 'cron = "0 5 * * *"', "every-host:web"),
    ("ping", 'every = "1m"', "every-host"),
)


def _jobs() -> dict[str, FileJob]:
    return {j.name: j for j in parse_text(TEXT, "/etc/scheduled/jobs.d/a.toml").jobs}


def test_this_host_and_every_host_jobs_are_per_host() -> None:
    jobs = _jobs()
    backup, ping = jobs["backup"], jobs["ping"]
    assert pl.central_name(backup, "web1") == "backup@web1"
    assert pl.queue_for(backup, "web1") == "host:web1"
    assert pl.central_name(ping, "web2") == "ping@web2"
    # an every-host job's own queue: runs reach it only while the host's worker is live
    assert pl.queue_for(ping, "web2") == "every:web2"


def test_group_job_is_one_central_job_on_the_group_queue() -> None:
    report = _jobs()["report"]
    assert pl.central_name(report, "web1") == "report"
    assert pl.queue_for(report, "web2") == "group:batch"


def test_every_host_of_a_group_applies_only_in_that_group() -> None:
    rotate = _jobs()["rotate"]
    assert pl.applies_to(rotate, "web1", ["web"])
    assert not pl.applies_to(rotate, "db1", ["db"])
    assert pl.applies_to(_jobs()["backup"], "db1")


def test_host_queues() -> None:
    assert pl.host_queues("web1", ["web", "batch", "web"]) == [
        "host:web1",
        "every:web1",
        "group:batch",
        "group:web",
    ]


@pytest.mark.parametrize("bad", ["", "-x", "a b", "a/b", "x" * 64, "é"])
def test_bad_host_names_are_refused_naming_host(bad: str) -> None:
    with pytest.raises(errors.ConfigError) as info:
        pl.host_queue(bad)
    assert info.value.field == "host"
