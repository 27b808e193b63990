"""A restore of Postgres to an earlier point, on real servers, the two ways docs/operations.md's
backup section describes: a `pg_dump -Fc` restored with pg_restore into the database dropped
and created again, and a base backup plus archived WAL recovered to a point in time. The
misfire policy decides what happens to the runs that fell due since the backup, and nothing
the restored database records is claimed or delivered twice.

Three jobs, every second, one per misfire policy. The dispatcher runs, the backup is taken
while it claims, it runs on (those runs are lost by the restore) and stops; the restore is
made and a new dispatcher starts on it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import closing
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import func, select

from schedctl.coordination.local import LocalCoordinator
from schedctl.domain.models import run_key
from schedctl.scheduling.misfire import MisfirePolicy
from schedctl.storage.db import schema
from schedctl.storage.db.migrate import upgrade
from schedctl.storage.db.store import Store
from scheduled_d.dispatcher import Dispatcher
from tests.factories import create_job, every, make_tenant
from tests.services.pg_backup import (
    ArchivingPostgres,
    pg_dump,
    pg_restore,
    recovered_server,
    recreate_database,
    wait_writable,
)
from tests.services.postgres import PostgresServer

pytestmark = pytest.mark.postgres

WAIT = 60.0  # the bound of every wait; nothing here is timed
GRACE = 1
POLICIES = (MisfirePolicy.run_all, MisfirePolicy.run_once, MisfirePolicy.skip)
Key = tuple[str, datetime]


@dataclass(frozen=True)
class Row:
    status: str
    dispatched_at: datetime | None
    finished_at: datetime | None  # a skipped run's: the time of the claim that skipped it
    epoch: int | None

    @property
    def claimed_at(self) -> datetime | None:
        """The claim's time: every row one claim writes carries the same."""
        return self.dispatched_at if self.status == "dispatched" else self.finished_at


class Running:
    """An in-process dispatcher owning every partition (the embedded mode's coordinator)."""

    def __init__(self, store: Store) -> None:
        self.coordinator = LocalCoordinator(store, "d1")
        self.coordinator.start()
        self.dispatcher = Dispatcher(store, self.coordinator, owner="d1")
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.dispatcher.run, args=(self.stop,))
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(30)
        assert not self.thread.is_alive()
        self.coordinator.stop()


@pytest.fixture
def running() -> Iterator[list[Running]]:
    """Every dispatcher a test starts, stopped at the end whatever happened."""
    made: list[Running] = []
    yield made
    for item in made:
        if item.thread.is_alive():
            item.close()


def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT
    for _ in range(int(WAIT / 0.1) + 1):
        if condition():
            return
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    pytest.fail(f"not within {WAIT:g} s: {what}")


def runs(store: Store) -> dict[Key, Row]:
    r = schema.runs
    with store.read() as connection:
        rows = connection.execute(
            select(
                r.c.job_id,
                r.c.scheduled_at,
                r.c.status,
                r.c.dispatched_at,
                r.c.finished_at,
                r.c.epoch,
            )
        ).all()
    return {(row[0], row[1]): Row(row[2], row[3], row[4], row[5]) for row in rows}


def deliveries(store: Store) -> dict[Key, int]:
    """Queue messages per run (every job here has a queue target)."""
    m = schema.queue_messages
    with store.read() as connection:
        rows = connection.execute(
            select(m.c.job_id, m.c.scheduled_at, func.count()).group_by(
                m.c.job_id, m.c.scheduled_at
            )
        ).all()
    return {(row[0], row[1]): int(row[2]) for row in rows}


def per_job(found: dict[Key, Row], job_id: str) -> list[tuple[datetime, Row]]:
    return sorted((at, row) for (job, at), row in found.items() if job == job_id)


def next_runs(store: Store) -> dict[str, datetime]:
    j = schema.jobs
    with store.read() as connection:
        rows = connection.execute(select(j.c.job_id, j.c.next_run_at)).all()
    return {row[0]: row[1] for row in rows}


def run_through_a_backup(
    url: str, running: list[Running], backup: Callable[[Store], None]
) -> tuple[dict[MisfirePolicy, str], dict[Key, Row]]:
    """A job per misfire policy, every second; the dispatcher runs, `backup` is taken while
    it claims, then it runs on for three more runs of each job and stops. Returns the jobs
    and every run recorded at the end (the runs after the backup are lost by the restore)."""
    with closing(Store.open(url)) as store:
        tenant = make_tenant(store)
        anchor = store.now().replace(microsecond=0) + timedelta(seconds=1)
        jobs = {
            policy: create_job(
                store,
                tenant,
                every(1, anchor, queue="backups", misfire=policy, grace=GRACE, name=policy.value),
            )
            for policy in POLICIES
        }
        running.append(Running(store))
        wait_for(lambda: len(runs(store)) >= 2 * len(jobs), "two runs of each job")
        backup(store)  # live: the dispatcher goes on claiming meanwhile
        after = len(runs(store))
        wait_for(lambda: len(runs(store)) >= after + 3 * len(jobs), "runs after the backup")
        running[-1].close()
        return jobs, runs(store)


def restart_and_check(
    url: str, jobs: dict[MisfirePolicy, str], before_restore: dict[Key, Row], running: list[Running]
) -> None:
    """Start a dispatcher on the restored database at `url` and prove that the misfire
    policies decide what happens to the times due since the backup, and that nothing the
    restored database records is claimed or delivered again."""
    with closing(Store.open(url)) as store:
        restored = runs(store)
        restored_deliveries = deliveries(store)
        assert restored, "the backup holds no run"
        assert set(restored) < set(before_restore), "the restore went back to the backup"
        lost = set(before_restore) - set(restored)
        for key, row in restored.items():
            assert row == before_restore[key]
        # the times due since the dump are past their grace when the dispatcher starts
        latest = max(next_runs(store).values())
        wait_for(
            lambda: store.now() > latest + timedelta(seconds=GRACE + 1), "the missed times misfire"
        )
        restart_at = store.now()
        running.append(Running(store))
        wait_for(
            lambda: all(
                any(
                    at > restart_at and row.status == "dispatched"
                    for at, row in per_job(runs(store), j)
                )
                for j in jobs.values()
            ),
            "every job dispatched again on time",
        )
        running[-1].close()
        final = runs(store)
        final_deliveries = deliveries(store)

    # nothing the restored database recorded changed or was delivered again
    for key, row in restored.items():
        assert final[key] == row, f"{key} recorded before the dump was claimed again"
        assert final_deliveries.get(key, 0) == restored_deliveries.get(key, 0)
    assert all(count == 1 for count in final_deliveries.values()), "a run delivered twice"
    redelivered = {
        key for key in lost if final.get(key, Row("", None, None, None)).status == "dispatched"
    }

    for policy, job_id in jobs.items():
        dumped = [at for at, _ in per_job(restored, job_id)]
        history = per_job(final, job_id)
        times = [at for at, _ in history]
        # every occurrence from the first has its row: dispatched, or recorded skipped
        assert times == [times[0] + timedelta(seconds=i) for i in range(len(times))], policy
        since = [(at, row) for at, row in history if at > max(dumped)]
        missed = [(at, row) for at, row in since if at <= restart_at]
        assert missed, f"{policy}: no time fell due between the backup and the restart"
        dispatched = [at for at, row in missed if row.status == "dispatched"]
        skipped = [at for at, row in missed if row.status == "skipped"]
        # the first claim after the restart: what it dispatched besides recording skips
        first_claim = min(row.claimed_at for _, row in since if row.claimed_at is not None)
        in_first = [(at, row) for at, row in since if row.claimed_at == first_claim]
        caught_up = [at for at, row in in_first if row.status == "dispatched"]
        if policy is MisfirePolicy.run_all:
            # every missed time dispatched, the runs the restore lost among them
            assert not skipped and len(dispatched) == len(missed), policy
        elif policy is MisfirePolicy.run_once:
            # one claim records the missed times skipped and dispatches the latest one
            assert len(skipped) >= len(missed) - 1 >= 1, policy
            assert len(caught_up) == 1 and all(at < caught_up[0] for at in skipped), policy
            assert all(row.claimed_at == first_claim for at, row in missed if at in skipped)
        else:
            # the missed times recorded skipped, nothing dispatched for them: the next run
            # is the first time within its grace
            assert skipped and not caught_up, policy
            assert all(at >= restart_at - timedelta(seconds=GRACE) for at in dispatched), policy
        print(
            f"\n{policy}: {len(dumped)} runs in the backup, {len(missed)} times due between the "
            f"backup and the restart: {len(dispatched)} dispatched, {len(skipped)} skipped"
        )
    # a run the restore lost and that ran again reaches its target with the same key
    assert lost, "no run was lost by the restore: the test proves nothing"
    assert any(key[0] == jobs[MisfirePolicy.run_all] for key in redelivered)
    print(
        f"runs lost by the restore: {len(lost)}, dispatched again after it: {len(redelivered)} "
        f"(same Idempotency-Key, e.g. {run_key(*sorted(redelivered)[0])})"
    )


def test_a_restore_to_an_earlier_point_applies_the_misfire_policy_and_runs_nothing_twice(
    pg_server: PostgresServer, pg_url: str, tmp_path: Path, running: list[Running]
) -> None:
    """pg_dump -Fc, then pg_restore into the database dropped and created again."""
    dbname = pg_url.rsplit("/", 1)[1]
    dump = tmp_path / "scheduled.dump"
    jobs, before_restore = run_through_a_backup(
        pg_url, running, lambda _: pg_dump(pg_server, dbname, dump)
    )
    # every daemon stopped; the database made again, empty, and the dump restored into it
    recreate_database(pg_server, dbname)
    assert pg_restore(pg_server, dbname, dump) == ""
    restart_and_check(pg_url, jobs, before_restore, running)


@pytest.fixture
def archiving_pg() -> Iterator[ArchivingPostgres]:
    """A Postgres of its own that archives its WAL (the test stops it)."""
    server = ArchivingPostgres()
    try:
        server.start()
        yield server
    finally:
        server.cleanup()


@pytest.mark.slow
def test_a_point_in_time_recovery_applies_the_misfire_policy_and_runs_nothing_twice(
    archiving_pg: ArchivingPostgres, running: list[Running]
) -> None:
    """A base backup plus the archived WAL, recovered to a time while the dispatcher claimed
    (recovery_target_time, then promote), on a new server."""
    archiving_pg.create_database("scheduled")
    url = archiving_pg.url("scheduled")
    upgrade(url)
    backup = archiving_pg.base_dir / "recovered" / "data"
    targets: list[datetime] = []

    def base_backup_then_mark(store: Store) -> None:
        archiving_pg.base_backup(backup)
        targets.append(store.now())  # the point to recover to: after the backup ended

    jobs, before_restore = run_through_a_backup(url, running, base_backup_then_mark)
    archiving_pg.archive_current_wal()  # the WAL past the target is in the archive
    archiving_pg.stop()  # the database is lost; the backup and the archive are not
    recovered = recovered_server(backup, archiving_pg.archive_dir, targets[0])
    try:
        recovered.start()
        wait_writable(recovered)
        restart_and_check(recovered.url("scheduled"), jobs, before_restore, running)
    finally:
        recovered.stop("immediate")
