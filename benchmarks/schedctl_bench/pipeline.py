"""Owns the whole-path benchmarks behind `schedctl bench burst` and `bench steady`: real
`scheduled-d` dispatcher, relay and worker processes on loopback, runs due at one instant
(burst) or at a steady rate, and for each stage of a run -- claimed, delivered (in the
built-in queue, or received by a loopback HTTP receiver), started, finished -- how late after
its due instant it got there; duplicates, missing runs and each process's peak RSS. Measured
and reported, never asserted. Use a scratch database: a run adds a tenant with its jobs and
runs, and deletes them at the end."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple

from schedctl.core import errors
from schedctl.domain.models import run_key
from schedctl.storage.db.store import Store
from schedctl_bench import measure
from schedctl_bench.consumers import Consumers
from schedctl_bench.dispatch import Dispatchers, bench_tenant
from schedctl_bench.receiver import Receiver
from schedctl_bench.storage import bench as bench_rows
from schedctl_bench.storage import bench_sizes
from schedctl_bench.storage.bulk import insert_once_jobs

STAGES = ("claimed", "delivered", "started", "finished")
POLL_SECONDS = 0.2
# runs has no tenant index: counting the finished ones scans the run history, so it is
# done this seldom (the stages' times come from the history, not from this count)
DONE_POLL_SECONDS = 1.0
SAMPLE_SECONDS = 0.05  # queue messages live until a worker acks them: look often
SAMPLE_LIMIT = 20_000
# ids of concurrent transactions commit out of order: each look re-reads this many
SAMPLE_OVERLAP = 2_000
# ... and a claim batch of 10,000 commits its messages after a later batch's: a look that
# finds nothing new reads the whole queue again, at most this often
SAMPLE_RESCAN_SECONDS = 1.0
HTTP_LANE_WIDTH = 64  # the bench tenant's delivery_concurrency
SPAWN_THREADS = 16
STEADY_LEAD_SECONDS = 5.0
MIN_RATE_SPAN_SECONDS = 0.05
STOP_GRACE_SECONDS = 30.0

Run = tuple[str, datetime]  # (job_id, scheduled_at)


@dataclass(frozen=True)
class Plan:
    """The processes of one run: what they deliver to and how many of each."""

    target: str  # "queue" or "http"
    dispatchers: Dispatchers
    relays: int = 1
    workers: int = 1
    worker_concurrency: int = 16
    timeout: float = 300.0
    spawn_seconds: float = 0.0  # measure the spawn ceiling this long first; 0: not
    api_workers: int = 0  # tenant workers over a `scheduled-d api` (queue target only)
    # one `scheduled-d all` (the embedded default) with a [[worker]] table if `workers`,
    # instead of separate dispatcher, relay and worker processes
    embedded: bool = False


class Spawns(NamedTuple):
    """What starting /bin/true costs on this machine: starts a second from many threads,
    and the CPU of one start, the child's included (user and system, both cores)."""

    per_second: float
    cpu_ms_per_start: float | None


def spawn_ceiling(seconds: float, threads: int = SPAWN_THREADS) -> Spawns:
    """Starts of /bin/true per second from `threads` Python threads for `seconds`: the most a
    worker process could start on this machine; and the CPU each start took."""
    deadline = time.monotonic() + seconds
    counts = [0] * threads

    def spawn(slot: int) -> None:
        while time.monotonic() < deadline:
            subprocess.run(["/bin/true"], check=False)
            counts[slot] += 1

    cpu_before = _cpu_with_children()
    began = time.monotonic()
    pool = [threading.Thread(target=spawn, args=(i,), daemon=True) for i in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join(seconds + 30)
    elapsed = max(time.monotonic() - began, 1e-6)
    started = sum(counts)
    cpu = _cpu_with_children() - cpu_before
    return Spawns(started / elapsed, round(cpu * 1000 / started, 3) if started else None)


def _cpu_with_children() -> float:
    """This process's CPU seconds and its waited-for children's (user and system)."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


class _QueueSampler:
    """Looks at the tenant's queue messages every SAMPLE_SECONDS until stopped, keeping when
    each run first appeared there: the start of the look that saw it, which its commit came
    before. Not the message's created_at: that is the claim's clock when its transaction
    began, before the commit by as much as the transaction took (an embedded burst's
    10,000 runs, claimed in one SQLite transaction, were all stamped at the instant). A
    message leased and acknowledged between two looks is not seen (its delivery is then
    bounded by its start)."""

    def __init__(self, store: Store, tenant_id: str) -> None:
        self.store, self.tenant_id = store, tenant_id
        self.seen: dict[Run, datetime] = {}
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        after = 0
        rescanned = time.monotonic()
        while not self.stopping.wait(SAMPLE_SECONDS):
            known = len(self.seen)
            for _ in range(100):  # a backlog is read in chunks, each look bounded
                looked = datetime.now(UTC)
                try:
                    rows = bench_rows.queued_since(self.store, self.tenant_id, after, SAMPLE_LIMIT)
                except errors.StoreUnavailable:
                    # SQLite: "database is locked" while a claim or a move holds the one
                    # write lock past the busy timeout; look again at the next tick (this
                    # thread dying left every run unseen: 10,000 "missing")
                    break
                for _id, job_id, at in rows:
                    self.seen.setdefault((job_id, at), looked)
                if rows:
                    after = max(after, rows[-1][0] - SAMPLE_OVERLAP)
                if len(rows) < SAMPLE_LIMIT:
                    break
            if len(self.seen) == known and time.monotonic() - rescanned >= SAMPLE_RESCAN_SECONDS:
                # messages below the mark may have committed since it passed them (the
                # claim writes them in batches that run side by side): look from the start
                after, rescanned = 0, time.monotonic()

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        if self.thread.is_alive():
            self.thread.join(60)


class _Processes:
    """Every process of a run by name, their peak RSS and their CPU seconds as last sampled
    (VmHWM and CPU time only grow, so the last look before the stop is the figure). CPU
    seconds are what a loaded machine does not distort: a stage's cost per run."""

    def __init__(self) -> None:
        self.pids: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self.cpu: dict[str, float] = {}
        self.commands_cpu: dict[str, float] = {}  # a worker's exited commands
        # a local Postgres's client backends: pid -> [application_name, first, last] CPU
        # seconds; None once the server turned out not to be this machine's
        self.backends: dict[int, list[Any]] | None = {}

    def sample(self) -> None:
        for name, pid in self.pids.items():
            value = measure.peak_rss_bytes(pid)
            if value is not None:
                self.peak[name] = max(value, self.peak.get(name, 0))
            cpu = measure.cpu_seconds(pid)
            if cpu is not None:
                self.cpu[name] = max(cpu, self.cpu.get(name, 0.0))
            if "worker" in name:
                spent = measure.cpu_seconds(pid, children=True)
                if spent is not None:
                    self.commands_cpu[name] = max(spent, self.commands_cpu.get(name, 0.0))

    def sample_backends(self, store: Store) -> None:
        """The CPU time of the database's sessions so far, when Postgres is on this
        machine: what each kind of process (application_name) costs the server."""
        if self.backends is None:
            return
        sessions = bench_rows.local_backends(store)
        if sessions is None:
            self.backends = None
            return
        for pid, application in sessions.items():
            cpu = measure.cpu_seconds(pid)
            if cpu is None:
                continue
            seen = self.backends.setdefault(pid, [application, cpu, cpu])
            seen[2] = max(seen[2], cpu)

    def backend_cpu(self) -> dict[str, float] | None:
        """Postgres CPU seconds by application_name since each session was first seen."""
        if self.backends is None:
            return None
        spent: dict[str, float] = {}
        for application, first, last in self.backends.values():
            name = application or "(unnamed)"  # psql and other tools may set none
            spent[name] = spent.get(name, 0.0) + last - first
        return {k: round(v, 2) for k, v in sorted(spent.items())}


def _per_100k_runs(seconds: dict[str, float], runs: int) -> dict[str, float]:
    """CPU seconds per process scaled to 100,000 runs: a stage's cost per run."""
    return {k: round(v * 100_000 / max(runs, 1), 2) for k, v in seconds.items()}


def lateness(pairs: Sequence[tuple[datetime, float]]) -> dict[str, float | int | None]:
    """{last, p50, p99, max, count} of (due instant, unix time reached) pairs: `last` is from
    the latest due instant to the latest arrival (for a burst, from the due instant to the
    last run)."""
    if not pairs:
        return {"last": None, "p50": None, "p99": None, "max": None, "count": 0}
    late = sorted(reached - due.timestamp() for due, reached in pairs)
    last = max(reached for _, reached in pairs) - max(due for due, _ in pairs).timestamp()

    def pct(q: float) -> float:
        return round(measure.percentile(late, q) or 0.0, 3)

    return {
        "last": round(last, 3),
        "p50": pct(50),
        "p99": pct(99),
        "max": round(late[-1], 3),
        "count": len(late),
    }


def _rate(times: Sequence[float]) -> float | None:
    """Arrivals per second between the first and the last arrival."""
    span = max(times) - min(times) if times else 0.0
    if len(times) < 2 or span < MIN_RATE_SPAN_SECONDS:
        return None  # all at one instant (one claim statement): no rate to speak of
    return round((len(times) - 1) / span, 1)


class _Bench:
    """One whole-path run: set up, load, wait, measure."""

    def __init__(self, store: Store, plan: Plan) -> None:
        self.store, self.plan = store, plan
        self.tenant_id, token = bench_tenant(store)
        self.tenant = bench_rows.tenant_name(store, self.tenant_id)
        self.queue = f"bench-{uuid.uuid4().hex[:8]}"
        self.receiver: Receiver | None = None
        self.sampler: _QueueSampler | None = None
        self.procs = _Processes()
        self.first_due: datetime | None = None  # the first run's instant, once loaded
        self.consumers = Consumers(
            plan.dispatchers.url,
            self.queue,
            workers=plan.workers if plan.target == "queue" and not plan.embedded else 0,
            relays=0 if plan.embedded else plan.relays,
            concurrency=plan.worker_concurrency,
            tenant=self.tenant,
            logdir=plan.dispatchers.logdir,
            api_workers=plan.api_workers if plan.target == "queue" else 0,
            api_token=token,
        )

    def start_consumers(self) -> str:
        """The receiver (HTTP) and the relays and workers, before any load: their start-up
        must not eat the lead. Returns the jobs' target (a queue name or the receiver URL)."""
        target = self.queue
        if self.plan.target == "http":
            self.receiver = Receiver()
            self.procs.pids["receiver"] = self.receiver.process.pid
            target = self.receiver.url
            bench_rows.set_tenant_columns(
                self.store,
                self.tenant_id,
                {
                    "delivery_concurrency": HTTP_LANE_WIDTH,
                    "allow_list": json.dumps(["127.0.0.1/32"]),
                },
            )
        else:
            self.sampler = _QueueSampler(self.store, self.tenant_id)
        self.consumers.start()
        for p in self.consumers.processes:
            if p.popen is not None:
                self.procs.pids[p.name] = p.popen.pid
        return target

    def load_far(self, target: str, count: int, name: str) -> None:
        """`count` one-time jobs of `target`, due a day ahead (moved to their instants once
        loaded, so that the load's time does not eat the lead)."""
        far = datetime.now(UTC) + timedelta(days=1)
        insert_once_jobs(
            self.store,
            self.tenant_id,
            [far] * count,
            name=name,
            queue=target,
            target_type=self.plan.target,
            grace_seconds=86_400,
        )

    def start_dispatchers(self) -> None:
        group = self.plan.dispatchers
        if self.plan.embedded:
            group.mode, group.config = "all", group.logdir / "scheduled.toml"
            group.config.write_text(self._embedded_config())
        group.start()
        for i, popen in enumerate(group.processes):
            self.procs.pids[f"{group.mode}-{i}"] = popen.pid
        if self.sampler is not None:
            self.sampler.start()

    def _embedded_config(self) -> str:
        """`scheduled-d all`'s configuration: a [[worker]] on the bench queue if workers."""
        if not (self.plan.workers and self.plan.target == "queue"):
            return ""
        return (
            "[[worker]]\n"
            f"queue = {json.dumps(self.queue)}\n"
            f"tenant = {json.dumps(self.tenant)}\n"
            'command = ["/bin/true"]\n'
            f"concurrency = {self.plan.worker_concurrency}\n"
        )

    def _done(self) -> int:
        """Runs at the last stage this run has: received (HTTP), finished (queue with
        workers), or in the queue (without)."""
        if self.receiver is not None:
            distinct: int = self.receiver.count()["distinct"]
            return distinct
        if self.plan.workers or self.plan.api_workers:
            return bench_rows.count_runs(self.store, self.tenant_id, status="succeeded")
        assert self.sampler is not None
        return len(self.sampler.seen)

    def wait(self, total: int, seconds: float) -> bool:
        """Until `total` runs are done, `seconds` pass or a process exits; whether all were."""
        deadline = time.monotonic() + seconds
        next_count = 0.0
        while time.monotonic() < deadline:
            self.procs.sample()
            if time.monotonic() >= next_count:
                self.procs.sample_backends(self.store)
                if self._done() >= total:
                    return True
                next_count = time.monotonic() + DONE_POLL_SECONDS
            if self.consumers.dead() or any(
                p.poll() is not None for p in self.plan.dispatchers.processes
            ):
                return False
            time.sleep(POLL_SECONDS)
        return False

    def stop(self) -> dict[str, int | None]:
        self.procs.sample()
        self.procs.sample_backends(self.store)
        if self.sampler is not None:
            self.sampler.stop()
        return self.plan.dispatchers.stop() | self.consumers.stop()

    def close(self) -> None:
        """Whatever still runs after a failure is killed; the receiver stops."""
        if self.sampler is not None:
            self.sampler.stop()
        for popen in self.plan.dispatchers.processes:
            if popen.poll() is None:
                popen.kill()
                popen.wait(10)
        self.consumers.kill()
        if self.receiver is not None:
            self.receiver.close()
        # what is left (outbox rows whose receiver is gone, unclaimed jobs, queue messages)
        # would otherwise be delivered, claimed or counted by the next benchmark here
        bench_rows.delete_tenant(self.store, self.tenant_id)

    def measure(self, total: int) -> dict[str, Any]:
        history = bench_rows.run_stages(self.store, self.tenant_id)
        received: dict[str, list[float]] = self.receiver.keys() if self.receiver else {}
        stages: dict[str, list[tuple[datetime, float]]] = {s: [] for s in STAGES}
        unseen = 0
        for job_id, at, dispatched, started, finished in history:
            for stage, when in (("claimed", dispatched), ("started", started)):
                if when is not None:
                    stages[stage].append((at, when.timestamp()))
            if finished is not None:
                stages["finished"].append((at, finished.timestamp()))
            delivered = self._delivered(job_id, at, received)
            if delivered is None and started is not None and self.plan.target == "queue":
                delivered, unseen = started.timestamp(), unseen + 1  # an upper bound
            elif delivered is not None and started is not None and self.plan.target == "queue":
                # seen is an upper bound too (a look every SAMPLE_SECONDS): a run was in
                # the queue before a worker started it
                delivered = min(delivered, started.timestamp())
            if delivered is not None:
                stages["delivered"].append((at, delivered))
        duplicates = sum(len(times) - 1 for times in received.values())
        duplicates += bench_rows.extra_executions(self.store, self.tenant_id)
        executes = self.plan.target == "queue" and (self.plan.workers or self.plan.api_workers)
        last = "finished" if executes else "delivered"
        result: dict[str, Any] = {
            f"{stage}_after_due_seconds": lateness(pairs) for stage, pairs in stages.items()
        }
        result.update(
            {f"{stage}_per_second": _rate([t for _, t in pairs]) for stage, pairs in stages.items()}
        )
        result.update(
            {
                "runs": total,
                "duplicates": duplicates,
                "missing": total - len(stages[last]),
                "missing_counted_at": last,
                "delivered_unseen_in_queue": unseen,
            }
        )
        return result

    def _delivered(
        self, job_id: str, at: datetime, received: dict[str, list[float]]
    ) -> float | None:
        if self.receiver is not None:
            times = received.get(run_key(job_id, at))
            return min(times) if times else None
        assert self.sampler is not None
        seen = self.sampler.seen.get((job_id, at))
        return seen.timestamp() if seen is not None else None


def _run(
    store: Store,
    plan: Plan,
    total: int,
    load: Callable[[_Bench, str], float],
    wait_seconds: float,
) -> dict[str, Any]:
    """The common course: spawn ceiling, consumers, `load` (returns its seconds; sets
    `first_due`), dispatchers, the wait (`wait_seconds` after the first due instant), the
    stop, the measurement."""
    spawns = spawn_ceiling(plan.spawn_seconds) if plan.spawn_seconds > 0 else None
    bench_sizes.clear_dead_rows(store)
    load_before = os.getloadavg()
    bench = _Bench(store, plan)
    try:
        target = bench.start_consumers()
        load_seconds = load(bench, target)
        # the jobs' statistics as autovacuum keeps a table's that grows as it is used: made
        # seconds before the instant, the load was otherwise planned for as the empty
        # table a former run's deletion left, or not, as autovacuum's minute fell (the
        # relays' claims then probe jobs through ix_jobs_tenant, a whole index walk per run)
        bench_sizes.vacuum_analyze(store, "jobs")
        assert bench.first_due is not None
        margin = (bench.first_due - datetime.now(UTC)).total_seconds()
        bench.start_dispatchers()
        complete = bench.wait(total, max(margin, 0.0) + wait_seconds)
        exits = bench.stop()
        result = bench.measure(total)
    finally:
        bench.close()
    procs = bench.procs.peak | {"bench": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    backend_cpu = bench.procs.backend_cpu()
    result.update(
        {
            "target": plan.target,
            "database": bench_rows.database_settings(store),
            "dispatchers": plan.dispatchers.count,
            "relays": 0 if plan.embedded else plan.relays,
            "embedded": plan.embedded,
            "workers": plan.workers if plan.target == "queue" else 0,
            "api_workers": plan.api_workers if plan.target == "queue" else 0,
            "worker_concurrency": plan.worker_concurrency,
            "batch_size": plan.dispatchers.batch_size,
            "load_seconds": round(load_seconds, 2),
            # steady: how long before the first run's instant the dispatchers started
            "dispatchers_started_before_first_due_seconds": round(margin, 2),
            "complete": complete,
            # the machine's 1-minute load average before and after: others' load skews times
            "load_average": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
            "peak_rss_bytes": procs,
            # up to the stop (start-up included, shutdown not)
            "cpu_seconds": {k: round(v, 2) for k, v in bench.procs.cpu.items()},
            "cpu_seconds_per_100k_runs": _per_100k_runs(bench.procs.cpu, total),
            # the commands the workers started (/bin/true): the spawn's cost in the child
            "commands_cpu_seconds": {k: round(v, 2) for k, v in bench.procs.commands_cpu.items()},
            # a local Postgres's CPU serving each kind of process (None: not this machine's)
            "postgres_cpu_seconds": backend_cpu,
            "postgres_cpu_seconds_per_100k_runs": (
                _per_100k_runs(backend_cpu, total) if backend_cpu is not None else None
            ),
            "exit_codes": exits,
            "log_trouble": sum(len(v) for v in bench.consumers.trouble().values()),
            "logs": str(plan.dispatchers.logdir),
        }
    )
    if spawns is not None:
        result["spawn_ceiling_per_second"] = round(spawns.per_second, 1)
        result["spawn_cpu_ms_per_start"] = spawns.cpu_ms_per_start
        starts = result["started_per_second"]
        result["worker_starts_to_ceiling"] = (
            round(starts / spawns.per_second, 3) if starts else None
        )
    return result


def burst(store: Store, plan: Plan, *, jobs: int, lead_seconds: float) -> dict[str, Any]:
    """`jobs` one-time runs all due at one instant `lead_seconds` after the dispatchers
    start."""

    def load(bench: _Bench, target: str) -> float:
        began = time.monotonic()
        bench.load_far(target, jobs, "bench-burst")
        # the instant is set once loading is done, so it is the same lead for any size
        bench.first_due = datetime.now(UTC) + timedelta(seconds=lead_seconds)
        bench_rows.move_jobs_due(store, bench.tenant_id, bench.first_due)
        return time.monotonic() - began

    result = _run(store, plan, jobs, load, plan.timeout)
    return {"benchmark": "burst", "jobs": jobs, "lead_seconds": lead_seconds, **result}


def steady(
    store: Store,
    plan: Plan,
    *,
    rate: int,
    duration: float,
    lead_seconds: float = STEADY_LEAD_SECONDS,
) -> dict[str, Any]:
    """`rate` runs a second, each due at its own instant, for `duration` seconds. The jobs
    are loaded far ahead, then moved to their instants: the first `lead_seconds` plus half
    again the load's time after the load, so that moving them ends before the first."""
    total = max(1, int(rate * duration))

    def load(bench: _Bench, target: str) -> float:
        began = time.monotonic()
        bench.load_far(target, total, "bench-steady")
        inserted = time.monotonic() - began
        start = datetime.now(UTC) + timedelta(seconds=lead_seconds + 1.5 * inserted)
        ids = bench_rows.jobs_of(store, bench.tenant_id)
        bench_rows.set_jobs_due(
            store, [(job_id, start + timedelta(seconds=i / rate)) for i, job_id in enumerate(ids)]
        )
        bench.first_due = start
        return time.monotonic() - began

    result = _run(store, plan, total, load, duration + plan.timeout)
    return {"benchmark": "steady", "rate_per_second": rate, "duration_seconds": duration, **result}
