"""Owns the chaos tests: 3 dispatchers, a relay, workers, Postgres and ZooKeeper (standalone,
and a 3-server ensemble) under a steady load of one-time and every-second recurring jobs, some
of them cancelled along the way, through a sequence of faults:

    kill -9 of a dispatcher (then restarted)      SIGSTOP of one until its session expires
    restart of a ZooKeeper server (the leader)    restart of Postgres (stop -m fast, start)
    a dispatcher added                            a dispatcher removed (SIGTERM)

Workers consume the queues meanwhile: direct workers (database access) and, for one tenant,
tenant workers over the REST API (a `scheduled-d api` process; the workers hold the tenant's
token and no database setting), which ride through the Postgres restart on 503s and retries.

The invariant checker (checker.py) then proves over the run history, the outbox and the
queue that no run was claimed twice, no due run was lost and nothing was claimed after its
cancel; it prints its counts. Times (re-own after kill -9 and SIGSTOP, rebalances, claim
lateness) are measured and printed, never asserted: the invariants are.

The workload's recurring jobs use misfire policy run_all, so no occurrence may be legitimately
skipped however long a fault lasts: every occurrence up to the cutoff must have its run.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import random
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import func, select, update

from schedctl.core import errors
from schedctl.scheduling.misfire import MisfirePolicy
from schedctl.storage.db import schema
from schedctl.storage.db.store import Store
from schedctl.storage.jobs.jobs import JobRepo
from schedctl.storage.tenants.tenants import TenantRepo
from schedctl_bench.consumers import worker_accepts_tenant
from tests.chaos.checker import (
    WORKER_STATUSES,
    History,
    JobRecord,
    Report,
    RunRecord,
    check,
    load_history,
)
from tests.chaos.cluster import Cluster, DaemonDied, wait_until
from tests.factories import bulk_once_jobs, create_job, every, make_tenant, once_at
from tests.services.ports import ServiceError
from tests.services.postgres import PostgresServer
from tests.services.zookeeper import ZooKeeperEnsemble

DISPATCHERS = ["d1", "d2", "d3"]
# Consumed by workers during the faults: the recurring jobs' runs (claims of a job race
# the leases and acks of its earlier runs) and the live ones. The up-front one-time jobs'
# queue is left alone: a run a worker leased carries the worker's transaction id, not the
# claim's, and the fencing check orders claims by it (checker.py).
WORKLOAD_QUEUES = ["chaos-recurring", "chaos-live"]
TENANTS = ["alpha", "bravo", "charlie"]
# This tenant's queues are consumed through the API: its recurring queue by an API worker
# alone, its live queue by an API worker and a direct worker side by side.
API_TENANT = "alpha"
API_ONLY_QUEUES = ["chaos-recurring"]
# Catch-up is paced per tenant at its dispatch rate: low enough to engage after a fault.
TENANT_DISPATCH_RATE = 200
RECURRING_JOBS = 120  # every second each, from a few seconds after the start
ONCE_JOBS_UPFRONT = 3000  # spread over the expected length of the run
ONCE_HORIZON_SECONDS = 60.0
LIVE_CREATES_PER_TICK = 6  # one-time jobs created while the faults happen, due soon
TICK_SECONDS = 0.5
MAX_RECURRING_CANCELS = 12
PAUSE_SECONDS = 5.0  # quiet time between faults
WAIT_SECONDS = 60.0  # the bound of every wait for the cluster to recover (real times printed)
SETTLE_SECONDS = 90.0  # the bound of the final wait for every due run to be claimed
MAX_WORKLOAD_TICKS = 1200


# -- the workload ---------------------------------------------------------------------------


@dataclass
class Workload:
    """Jobs created up front and while the faults happen, and cancels, from a thread of the
    test process (through the job repository, as the API does, so dispatchers hear of them
    by notification)."""

    store: Store
    rng: random.Random = field(default_factory=lambda: random.Random(20240601))
    tenants: list[str] = field(default_factory=list)
    recurring: list[str] = field(default_factory=list)
    once: list[tuple[datetime, str]] = field(default_factory=list)  # (run_at, job_id) sorted
    cancelled: dict[str, int] = field(default_factory=dict)  # job_id -> version the cancel wrote
    created_live: int = 0
    store_errors: int = 0
    other_errors: list[str] = field(default_factory=list)
    ticks: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def setup(self) -> None:
        for name in TENANTS:
            self.tenants.append(make_tenant(self.store, name))
        with self.store.tx() as connection:
            connection.execute(
                update(schema.tenants).values(dispatch_rate_per_second=TENANT_DISPATCH_RATE)
            )
        now = self.store.now()
        anchor = now.replace(microsecond=0) + timedelta(seconds=4)
        for i in range(RECURRING_JOBS):
            self.recurring.append(
                create_job(
                    self.store,
                    self.tenants[i % len(self.tenants)],
                    every(
                        1,
                        anchor,
                        queue="chaos-recurring",
                        misfire=MisfirePolicy.run_all,
                        name=f"recurring-{i}",
                    ),
                )
            )
        span = ONCE_HORIZON_SECONDS - 3.0
        times = sorted(
            now + timedelta(seconds=3.0 + self.rng.random() * span)
            for _ in range(ONCE_JOBS_UPFRONT)
        )
        per_tenant: dict[str, list[datetime]] = {t: [] for t in self.tenants}
        for i, at in enumerate(times):
            per_tenant[self.tenants[i % len(self.tenants)]].append(at)
        for tenant, tenant_times in per_tenant.items():
            ids = bulk_once_jobs(self.store, tenant, tenant_times, queue="chaos-once")
            self.once.extend(zip(tenant_times, ids, strict=True))
        self.once.sort()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="chaos-workload", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)

    def _run(self) -> None:
        repo = JobRepo(self.store)
        for _ in range(MAX_WORKLOAD_TICKS):
            if self._stop.wait(TICK_SECONDS):
                return
            self.ticks += 1
            try:
                self._tick(repo)
            except errors.StoreUnavailable:
                self.store_errors += 1  # Postgres is restarting: try again next tick
            except Exception as exc:  # reported at the end; the load must go on
                self.other_errors.append(f"{type(exc).__name__}: {exc}")

    def _tick(self, repo: JobRepo) -> None:
        now = datetime.now(UTC)
        for _ in range(LIVE_CREATES_PER_TICK):
            at = now + timedelta(seconds=0.5 + self.rng.random() * 15)
            tenant = self.rng.choice(self.tenants)
            # names are unique per tenant: auto_name suffixes the default with the id
            job, _ = repo.create(
                tenant, once_at(at, queue="chaos-live", name="live"), actor="chaos", auto_name=True
            )
            bisect.insort(self.once, (at, job.job_id))
            self.created_live += 1
        # one-time jobs about to fire (a race with their claim) and some later ones
        soon = bisect.bisect_left(self.once, (now, ""))
        later = bisect.bisect_left(self.once, (now + timedelta(seconds=1), ""))
        victims = [self.once[i][1] for i in range(soon, min(later, soon + 2))]
        if later < len(self.once):
            victims.append(self.once[self.rng.randrange(later, len(self.once))][1])
        if self.ticks % 4 == 0:
            recurring = [j for j in self.recurring if j not in self.cancelled]
            if len(self.recurring) - len(recurring) < MAX_RECURRING_CANCELS:
                victims.append(self.rng.choice(recurring))
        for job_id in victims:
            if job_id in self.cancelled:
                continue
            try:
                job = repo.cancel(job_id, actor="chaos")
            except errors.Conflict:
                continue  # already cancelled
            self.cancelled[job_id] = job.version


# -- helpers --------------------------------------------------------------------------------


@dataclass
class Figures:
    """What the run measured, printed at the end (never asserted)."""

    lines: list[str] = field(default_factory=list)
    faults: list[str] = field(default_factory=list)
    marks: list[tuple[str, datetime]] = field(default_factory=list)  # phase starts

    def fault(self, name: str) -> None:
        """A fault is injected now (this machine's clock is the database's: one host)."""
        self.faults.append(name)
        self.marks.append((name, datetime.now(UTC)))

    def note(self, line: str) -> None:
        self.lines.append(line)
        print(line, flush=True)

    def seconds(self, what: str, took: float | None) -> None:
        """Print a measured time; Unrecovered if the wait for it ran out."""
        if took is None:
            raise Unrecovered(f"{what}: NOT within {WAIT_SECONDS:.0f} s")
        self.note(f"{what}: {took:.3f} s")


class Unrecovered(AssertionError):
    """The cluster did not come back from a fault within WAIT_SECONDS."""


def runs_count(store: Store) -> int:
    with store.read() as connection:
        return int(connection.execute(select(func.count()).select_from(schema.runs)).scalar_one())


@dataclass(frozen=True)
class Pending:
    """What is left to settle: active jobs due by the cutoff, and outbox rows of runs due
    by it (later runs keep coming: the recurring jobs fire on)."""

    due: int
    outbox: int

    @property
    def settled(self) -> bool:
        return self.due == 0 and self.outbox == 0


def pending(store: Store, cutoff: datetime) -> Pending:
    j, o = schema.jobs, schema.outbox
    with store.read() as connection:
        due = connection.execute(
            select(func.count()).where(j.c.status == "active", j.c.next_fire_at <= cutoff)
        ).scalar_one()
        outbox = connection.execute(
            select(func.count()).where(o.c.scheduled_at <= cutoff)
        ).scalar_one()
    return Pending(int(due), int(outbox))


def api_executions_since(store: Store, at: datetime) -> int:
    """Succeeded attempts that a tenant worker over the API started after `at`."""
    a = schema.run_attempts
    with store.read() as connection:
        return int(
            connection.execute(
                select(func.count()).where(
                    a.c.status == "succeeded", a.c.worker.like("api:%"), a.c.started_at > at
                )
            ).scalar_one()
        )


def lateness(runs: Iterable[RunRecord]) -> str:
    """Claim lateness (dispatched_at - fire_at) of `runs`: p50, p99, max."""
    values = sorted(
        (r.dispatched_at - r.fire_at).total_seconds()
        for r in runs
        if r.dispatched_at is not None and r.fire_at is not None
    )
    if len(values) < 2:
        return f"{len(values)} runs"
    quantiles = statistics.quantiles(values, n=100, method="inclusive")
    early = sum(1 for v in values if v < 0)
    return (
        f"p50 {quantiles[49]:.3f} s, p99 {quantiles[98]:.3f} s, max {values[-1]:.3f} s, "
        f"min {values[0]:.3f} s ({len(values)} runs"
        + (f"; {early} claimed BEFORE their fire time" if early else "")
        + ")"
    )


def lateness_by_phase(history: History, marks: list[tuple[str, datetime]]) -> str:
    """Lateness of the runs due in each phase: from one fault to the next, then the end."""
    bounds = [*marks, ("end", history.cutoff)]
    lines = []
    for (name, start), (_, end) in itertools.pairwise(bounds):
        due = [r for r in history.runs if r.fire_at is not None and start <= r.fire_at < end]
        lines.append(f"  due after {name} ({(end - start).total_seconds():.0f} s): {lateness(due)}")
    return "\n".join(lines)


def restart_zookeeper(zk: ZooKeeperEnsemble, figures: Figures) -> None:
    """Standalone: stop and start the server. Ensemble: kill -9 the leader, wait for a new
    one, start the old leader again."""
    if zk.size == 1:
        started = time.monotonic()
        figures.fault("zookeeper restart")
        zk.restart_server(0, timeout=WAIT_SECONDS)
        figures.note(f"zookeeper standalone restarted (serving again after {time_since(started)})")
        return
    leader = zk.leader()
    assert leader is not None, "the ensemble has no leader"
    started = time.monotonic()
    figures.fault("zookeeper leader kill -9 + restart")
    zk.kill_server(leader)
    others = [i for i in range(zk.size) if i != leader]
    elected, took = wait_until(
        lambda: next((i for i in others if zk.mode(i) == "leader"), None) is not None,
        WAIT_SECONDS,
        interval=0.1,
    )
    figures.seconds(
        f"zookeeper leader {leader} killed: new leader elected after",
        took if elected else None,
    )
    zk.start_server(leader)
    zk.wait_server_ready(leader, WAIT_SECONDS)
    figures.note(f"zookeeper server {leader} back as {zk.mode(leader)} ({time_since(started)})")


def new_epochs(cluster: Cluster, before: dict[int, int]) -> str:
    """How many partitions are owned under a new epoch (a new ZooKeeper session) now."""
    now = cluster.ownership()
    moved = sum(1 for p, e in before.items() if now.get(p, (e, None))[0] != e)
    return f"{moved} of {len(before)} partitions under a new epoch (sessions that expired)"


def time_since(started: float) -> str:
    return f"{time.monotonic() - started:.3f} s"


# -- the chaos test -------------------------------------------------------------------------


def inject_faults(
    cluster: Cluster, pg: PostgresServer, zk: ZooKeeperEnsemble, figures: Figures
) -> list[str]:
    """The fault sequence, with quiet pauses between faults; returns the dispatchers that are
    members at the end. Raises Unrecovered (or DaemonDied) when the cluster does not come
    back from a fault: the faults after it would prove nothing."""
    members = list(DISPATCHERS)
    time.sleep(PAUSE_SECONDS)

    def stop_and_wait_reowned(name: str, fault: str, stop: Callable[[str], object]) -> None:
        """Stop dispatcher `name` by `fault`; the figure is how soon its partitions move."""
        before = cluster.owned_by(name)
        figures.fault(fault)
        stop(name)
        figures.seconds(
            f"{fault}: its {len(before)} partitions owned again after",
            cluster.wait_reowned(before, WAIT_SECONDS),
        )

    # 1. kill -9 of a dispatcher, then a new process of it
    stop_and_wait_reowned("d1", "kill -9 d1", cluster.kill)
    cluster.start("d1")
    figures.seconds(
        "d1 restarted: balanced again after", cluster.wait_balanced(members, WAIT_SECONDS)
    )
    time.sleep(PAUSE_SECONDS)

    # 2. SIGSTOP until the session expires and the partitions move, then SIGCONT
    stop_and_wait_reowned("d2", "SIGSTOP d2", cluster.pause)
    fenced_before = cluster.count_in_logs("fenced off").get("d2", 0)
    cluster.resume("d2")
    figures.seconds(
        "d2 continued: balanced again after", cluster.wait_balanced(members, WAIT_SECONDS)
    )
    fenced = cluster.count_in_logs("fenced off").get("d2", 0) - fenced_before
    figures.note(f"claims of the woken d2 refused by the epoch check: {fenced} batch(es)")
    time.sleep(PAUSE_SECONDS)

    # 3. a ZooKeeper server restarts
    epochs = {p: e for p, (e, _) in cluster.ownership().items()}
    restart_zookeeper(zk, figures)
    figures.seconds(
        "after ZooKeeper: balanced again after", cluster.wait_balanced(members, WAIT_SECONDS)
    )
    figures.note(f"after ZooKeeper: {new_epochs(cluster, epochs)}")
    time.sleep(PAUSE_SECONDS)

    # 4. Postgres restarts (stop -m fast, start)
    count = runs_count(cluster.store)
    epochs = {p: e for p, (e, _) in cluster.ownership().items()}
    started = time.monotonic()
    figures.fault("postgres restart")
    pg.restart("fast")
    figures.note(f"postgres restarted in {time_since(started)}")
    resumed, took = wait_until(lambda: runs_count(cluster.store) > count, WAIT_SECONDS)
    figures.seconds("after Postgres: claims resumed after", took if resumed else None)
    figures.seconds("after Postgres: balanced after", cluster.wait_balanced(members, WAIT_SECONDS))
    figures.note(f"after Postgres: {new_epochs(cluster, epochs)}")
    time.sleep(PAUSE_SECONDS)

    # 5. a dispatcher added, 6. one removed
    figures.fault("d4 added")
    cluster.start("d4")
    members.append("d4")
    figures.seconds("d4 added: balanced after", cluster.wait_balanced(members, WAIT_SECONDS))
    time.sleep(PAUSE_SECONDS)
    started = time.monotonic()
    figures.fault("d3 removed (SIGTERM)")
    code = cluster.terminate("d3")
    members.remove("d3")
    figures.note(f"d3 SIGTERM: exited with {code} after {time_since(started)}")
    figures.seconds("d3 removed: balanced after", cluster.wait_balanced(members, WAIT_SECONDS))
    time.sleep(PAUSE_SECONDS)
    return members


@pytest.mark.chaos
@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.zookeeper
@pytest.mark.timeout(600)
def test_no_run_claimed_twice_lost_or_claimed_after_cancel_under_faults(
    cluster: Cluster, chaos_pg: PostgresServer, chaos_zk: ZooKeeperEnsemble
) -> None:
    began = time.monotonic()
    store = cluster.store
    figures = Figures()
    workload = Workload(store)
    workload.setup()
    figures.note(
        f"\n== chaos with ZooKeeper {'standalone' if chaos_zk.size == 1 else '3-server ensemble'}"
        f": {RECURRING_JOBS} jobs every second (run_all), {ONCE_JOBS_UPFRONT} one-time jobs up "
        f"front, {cluster.partition_count} partitions, session {cluster.session_timeout:g} s"
    )
    cluster.start("relay", "relay")
    workers = start_workers(cluster, workload)
    for name in DISPATCHERS:
        cluster.start(name)
    members = list(DISPATCHERS)
    workload.start()
    figures.marks.append(("start", datetime.now(UTC)))
    aborted: str | None = None
    try:
        figures.seconds(
            "3 dispatchers started and balanced", cluster.wait_balanced(members, WAIT_SECONDS)
        )
        members = inject_faults(cluster, chaos_pg, chaos_zk, figures)
    except (Unrecovered, DaemonDied, ServiceError) as exc:
        aborted = str(exc)
        figures.note(f"fault sequence stopped: {aborted}")
        with contextlib.suppress(errors.SchedError):
            figures.note("database sessions now:\n" + cluster.sessions_report())
        # bring everything back, so that what was claimed can still be checked
        for name in cluster.running_dispatchers():
            if cluster.daemons[name].paused:
                cluster.resume(name)
        chaos_zk.start(timeout=WAIT_SECONDS)
        members = cluster.running_dispatchers()
    finally:
        workload.stop()
    if not chaos_pg.is_running():
        chaos_pg.start()  # the checker needs it whatever happened

    # settle: everything due by the cutoff claimed and relayed
    cutoff = store.now()
    seen: list[Pending] = []

    def settle() -> bool:
        seen.append(pending(store, cutoff))
        return seen[-1].settled

    done, took = wait_until(settle, SETTLE_SECONDS, interval=0.2)
    figures.note(
        "settled (all due by the cutoff claimed, outbox empty) after "
        + (f"{took:.3f} s" if done else f"NOT within {SETTLE_SECONDS:.0f} s")
        + (f"; at the cutoff: {seen[0]}" if seen else "")
    )
    dead = cluster.dead()
    # the API last: its workers settle what they hold through it
    exits = {name: cluster.terminate(name) for name in [*members, "relay", *workers, "api"]}
    figures.note(f"daemons stopped with SIGTERM, exit codes: {exits}")

    history = load_history(store, cutoff, figures.faults)
    report = check(history)
    figures.note(
        f"workload: {len(workload.recurring)} recurring and {len(workload.once)} one-time jobs "
        f"({workload.created_live} created during the faults); {len(workload.cancelled)} "
        f"cancelled ({sum(1 for j in workload.cancelled if j in workload.recurring)} recurring); "
        f"{workload.store_errors} workload ticks hit the database restart"
    )
    executed = Counter(r.status for r in history.runs if r.status in WORKER_STATUSES)
    figures.note(f"runs that reached the workers (/bin/true) by status: {dict(executed)}")
    api_workers = [n for n in workers if n.startswith("api-worker")]
    logged = cluster.count_in_logs(": succeeded")
    retried = cluster.count_in_logs("retrying")
    unavailable = cluster.count_in_logs('" 503').get("api", 0)  # uvicorn's access log
    restarted = dict(figures.marks).get("postgres restart")
    api_after_restart = api_executions_since(store, restarted) if restarted else 0
    figures.note(
        f"runs executed by direct workers: {report.executed_direct}, by API workers: "
        f"{report.executed_api} (the API workers' logs: "
        f"{sum(logged.get(n, 0) for n in api_workers)} successes, "
        f"{sum(retried.get(n, 0) for n in api_workers)} retries; the API answered "
        f"{unavailable} requests with 503); "
        f"by API workers after the Postgres restart: {api_after_restart}"
    )
    figures.note(f"claim lateness, faults included: {lateness(history.runs)}")
    figures.note("claim lateness by phase:\n" + lateness_by_phase(history, figures.marks))
    figures.note("checker:\n" + report.summary())
    figures.note(f"chaos run took {time_since(began)}")

    # the workload's own record agrees with the database
    for job_id, version in workload.cancelled.items():
        job = history.jobs[job_id]
        assert job.cancelled and job.version == version, f"cancel of {job_id} not as recorded"
    assert not workload.other_errors, workload.other_errors[:5]
    assert report.runs_checked > 0 and report.occurrences_expected > 0
    assert report.ok, report.summary()
    assert executed["succeeded"] > 0, "the workers executed nothing"
    assert report.executed_direct > 0, "the direct workers executed nothing"
    assert report.executed_api > 0, "the API workers executed nothing"
    if restarted:
        assert api_after_restart > 0, "the API workers executed nothing after Postgres restarted"
    assert not dead, f"daemons exited by themselves: {dead}"
    assert aborted is None, f"the cluster did not recover: {aborted}"
    assert exits == dict.fromkeys(exits, 0), f"a daemon did not stop cleanly: {exits}"


def start_workers(cluster: Cluster, workload: Workload) -> list[str]:
    """Workers consuming every queue of the workload during the faults: direct workers, one
    per queue, or one per (tenant, queue) where `scheduled-d worker` takes --tenant; and a
    `scheduled-d api` with a tenant worker over it on each queue of API_TENANT (alone on
    API_ONLY_QUEUES), holding a token made here and no database setting."""
    per_tenant = worker_accepts_tenant()
    names = []
    for queue in WORKLOAD_QUEUES:
        for tenant in TENANTS if per_tenant else [None]:
            if tenant == API_TENANT and queue in API_ONLY_QUEUES:
                continue
            name = f"worker-{queue}" + (f"-{tenant}" if tenant else "")
            cluster.start_worker(name, queue, tenant=tenant)
            names.append(name)
    tenant_id = workload.tenants[TENANTS.index(API_TENANT)]
    token = TenantRepo(workload.store).new_token(tenant_id, actor="chaos")
    url = cluster.start_api("api")
    for queue in WORKLOAD_QUEUES:
        name = f"api-worker-{queue}-{API_TENANT}"
        cluster.start_api_worker(name, queue, url, token)
        names.append(name)
    return names


# -- the checker can fail ---------------------------------------------------------------------


T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)


def _clean_history() -> History:
    """Two partitions; a job every second (5 runs by the cutoff), a one-time job, and a
    cancelled recurring job with 2 runs, all delivered once, epochs growing in claim order."""
    jobs = {
        "rec": JobRecord("rec", 0, T0, 1, "active", 6),
        "once": JobRecord("once", 1, T0 + timedelta(seconds=2), None, "completed", 2),
        "gone": JobRecord("gone", 1, T0, 1, "cancelled", 4),  # 2 claims (-> v3), cancel -> v4
    }
    runs = []
    for i in range(5):
        epoch = 10 if i < 3 else 20  # partition 0 moved to a new owner after 3 runs
        runs.append(
            RunRecord(
                "rec", T0 + timedelta(seconds=i), 0, "dispatched", None, epoch, 1 + i, 100 + i
            )
        )
    runs.append(RunRecord("once", T0 + timedelta(seconds=2), 1, "dispatched", None, 11, 1, 102))
    runs.append(RunRecord("gone", T0, 1, "dispatched", None, 11, 1, 100))
    runs.append(RunRecord("gone", T0 + timedelta(seconds=1), 1, "dispatched", None, 11, 2, 101))
    return History(
        jobs=jobs,
        runs=runs,
        deliveries=[r.key for r in runs],
        cutoff=T0 + timedelta(seconds=4, milliseconds=500),
        faults=["doctored"],
    )


def _checked(history: History) -> Report:
    report = check(history)
    print(report.summary())
    return report


def _checked_with_one_more(run: RunRecord) -> Report:
    """The checker's report on the clean history with `run` claimed and delivered once more."""
    history = _clean_history()
    history.runs.append(run)
    history.deliveries.append(run.key)
    return _checked(history)


def test_the_checker_passes_a_clean_history() -> None:
    report = _checked(_clean_history())
    assert report.ok
    assert (report.runs_checked, report.occurrences_expected, report.cancelled_jobs) == (8, 6, 1)


def test_the_checker_reports_a_duplicate_delivery() -> None:
    history = _clean_history()
    key = history.runs[1].key
    history.deliveries.append(key)
    report = _checked(history)
    assert report.duplicate_deliveries == [key] and report.duplicates == 1 and not report.ok


def test_the_checker_reports_a_duplicate_claim() -> None:
    history = _clean_history()
    history.runs.append(history.runs[0])  # what the runs primary key forbids
    report = _checked(history)
    assert history.runs[0].key in report.duplicate_runs and not report.ok


def test_the_checker_reports_a_gap() -> None:
    history = _clean_history()
    gap = history.runs.pop(2)
    history.deliveries.remove(gap.key)
    report = _checked(history)
    assert report.missing == [gap.key] and not report.ok


def test_the_checker_reports_an_undelivered_run_and_a_delivery_without_run() -> None:
    history = _clean_history()
    lost = history.runs[3].key
    history.deliveries.remove(lost)
    stray = ("nobody", T0)
    history.deliveries.append(stray)
    report = _checked(history)
    assert report.undelivered == [lost] and report.orphan_deliveries == [stray]


def test_the_checker_counts_executions_by_worker_kind_and_reports_a_run_executed_twice() -> None:
    history = _clean_history()
    once, twice = history.runs[0].key, history.runs[1].key
    history.executions = [(once, "worker-a"), (twice, "api:tok:digest"), (twice, "worker-b")]
    report = _checked(history)
    assert (report.executed_direct, report.executed_api) == (2, 1)
    assert report.executed_twice == [twice] and report.duplicates == 1 and not report.ok


def test_the_checker_reports_a_run_claimed_after_cancel() -> None:
    late = RunRecord("gone", T0 + timedelta(seconds=2), 1, "dispatched", None, 11, 3, 103)
    report = _checked_with_one_more(late)
    assert report.after_cancel == [late.key] and not report.ok


def test_the_checker_reports_a_stale_claim_after_cancel_by_its_reused_version() -> None:
    # a claim that skipped the version condition: it read version 2 before the cancel,
    # committed after it; its job_version is older than the cancel, but version 2 was
    # already claimed
    stale = RunRecord("gone", T0 + timedelta(seconds=2), 1, "dispatched", None, 11, 2, 104)
    report = _checked_with_one_more(stale)
    assert report.version_reuse == [("gone", 2)] and not report.ok


def test_the_checker_reports_an_epoch_going_backwards() -> None:
    history = _clean_history()
    # the last run of partition 0 claimed by the former owner (epoch 10) after the new
    # owner's claims under epoch 20: a paused dispatcher that was not fenced
    last = history.runs[4]
    history.runs[4] = RunRecord(
        last.job_id, last.scheduled_at, 0, "dispatched", None, 10, last.job_version, 200
    )
    report = _checked(history)
    assert len(report.epoch_regressions) == 1 and "epoch 10" in report.epoch_regressions[0]
    assert not report.ok


def test_the_checker_reports_runs_at_no_occurrence() -> None:
    odd = RunRecord("rec", T0 + timedelta(milliseconds=1500), 0, "dispatched", None, 20, 9, 300)
    report = _checked_with_one_more(odd)
    assert report.unexpected == [odd.key] and not report.ok
