"""Every-host job files: applied on two hosts, each occurrence becomes one run per host, and
a run reaches its host's `every:HOST` queue only while that host's worker is live; a host
that is down gets its run recorded skipped (with the reason), not a backlog. SQLite and
Postgres, through the real apply, claim routing (move_outbox) and worker presence."""

from __future__ import annotations

from pathlib import Path

from schedctl.app import jobfiles_apply as applying
from schedctl.app.service import Scheduler
from schedctl.domain import jobfiles
from schedctl.storage.pipeline.queue import QueueRepo
from schedctl.storage.pipeline.settle import HOST_NOT_LIVE_ERROR
from schedctl.storage.pipeline.workers import WorkerRepo
from tests.integration.queue_support import messages, run_row, trigger
from tests.jobfile_texts import true_jobs

ACTOR = "test:every-host"

FILE = true_jobs(("ping", 'every = "1h"', "every-host"), ("backup", 'every = "1h"', None))


def _apply(sched: Scheduler, directory: Path, host: str) -> None:
    plan = applying.plan(
        jobfiles.load_dir(directory),
        host,
        (),
        applying.read_central(sched, "acme"),
        directory=directory,
        now=sched.store.now(),
    )
    applying.execute(sched, "acme", plan, actor=ACTOR)


def test_every_host_runs_reach_live_hosts_only(sched: Scheduler, tmp_path: Path) -> None:
    tenant_id = sched.create_tenant("acme", ACTOR)[0].tenant_id
    (tmp_path / "fleet.toml").write_text(FILE)
    for host in ("web1", "web2"):
        _apply(sched, tmp_path, host)
    jobs = {j.name: j for j in sched.list_jobs("acme", limit=100).items}
    assert jobs["ping@web1"].target.address == "every:web1"
    assert jobs["ping@web2"].target.address == "every:web2"
    assert jobs["backup@web2"].target.address == "host:web2"

    # web1's worker serves its queues; web2 is down (no worker was ever seen)
    WorkerRepo(sched.store).seen(tenant_id, "every:web1", "web1:1:w")
    # another tenant's worker of a queue with the same name is not acme's web2
    other_id = sched.create_tenant("other", ACTOR)[0].tenant_id
    WorkerRepo(sched.store).seen(other_id, "every:web2", "web2:1:other")
    at = {name: trigger(sched.store, jobs[name].job_id) for name in jobs}
    # this-host runs wait for their host either way; web2's every-host run is not queued
    assert QueueRepo(sched.store).move_outbox() == 3

    queued = {(m["queue"], m["job_id"]) for m in messages(sched.store)}
    assert queued == {
        ("every:web1", jobs["ping@web1"].job_id),
        ("host:web1", jobs["backup@web1"].job_id),
        ("host:web2", jobs["backup@web2"].job_id),
    }
    skipped = run_row(sched.store, jobs["ping@web2"].job_id, at["ping@web2"])
    assert skipped["status"] == "skipped"
    assert skipped["error"] == HOST_NOT_LIVE_ERROR
    assert run_row(sched.store, jobs["ping@web1"].job_id, at["ping@web1"])["status"] == (
        "dispatched"
    )
    # nothing is left in the outbox to route again
    assert QueueRepo(sched.store).move_outbox() == 0
