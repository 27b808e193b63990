"""Owns the stored-work-at-scale benchmark behind `schedctl bench scale`: with N future jobs
stored (and the same with a smaller --compare count), a real `scheduled-d dispatcher` owning
every partition claims a burst due now (claims per second, peak RSS), the dispatcher's due
read of the next window is timed (the same range read of the due index it preloads with), and
the bytes each stored job and each run-history row take are reported. On SQLite it also
runs the embedded burst (`scheduled-d all`) through schedctl_bench.pipeline. Measured and
reported, never asserted."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from schedctl.core import errors
from schedctl.storage.db.store import Store
from schedctl.storage.pipeline.claim import Claimer
from schedctl_bench import measure
from schedctl_bench.dispatch import Dispatchers, bench_tenant
from schedctl_bench.storage import bench as bench_rows
from schedctl_bench.storage import bench_sizes
from schedctl_bench.storage.bulk import insert_once_jobs
from schedctl_bench.storage.bulk_future import load_future_jobs

FUTURE_START = timedelta(days=1)  # the first future job: never due during the benchmark
FUTURE_SPAN = timedelta(days=365)  # the future jobs are spread evenly over this
BURST_PARKED = timedelta(days=800)  # burst jobs wait here, past every future job
WINDOW = timedelta(seconds=60)  # the dispatcher's preload window (Dispatcher.window_seconds)
PRELOAD_LIMIT = 200_000  # the dispatcher's preload_limit
POLL_SECONDS = 0.02  # how often the claimed runs are counted: the claim time's resolution


def _stats(samples: Sequence[float]) -> dict[str, float | int | None]:
    return {
        "p50_ms": measure.ms(measure.percentile(samples, 50)),
        "p99_ms": measure.ms(measure.percentile(samples, 99)),
        "max_ms": measure.ms(max(samples) if samples else None),
        "count": len(samples),
    }


def _ratio(big: float | None, small: float | None) -> float | None:
    if big is None or small is None or small == 0:
        return None
    return round(big / small, 3)


class _Level:
    """The measurements with a given number of future jobs stored."""

    def __init__(self, store: Store, url: str, burst: int, batch_size: int, lead: float) -> None:
        self.store, self.url, self.burst = store, url, burst
        self.batch_size, self.lead = batch_size, lead
        self.claimer = Claimer(store, "bench-scale")
        self.partitions = list(range(store.partition_count))

    def due_reads(self, reads: int) -> tuple[list[float], int]:
        """`reads` timings of the dispatcher's preload read of the next window over every
        partition; the rows the last one returned."""
        samples: list[float] = []
        rows = 0
        for _ in range(reads):
            began = time.perf_counter()
            rows = len(
                self.claimer.load_due(self.partitions, self.store.now() + WINDOW, PRELOAD_LIMIT)
            )
            samples.append(time.perf_counter() - began)
        return samples, rows

    def run(self, reads: int, timeout: float) -> dict[str, Any]:
        tenant_id, _ = bench_tenant(self.store)
        try:
            return self._run(tenant_id, reads, timeout)
        finally:
            bench_rows.delete_tenant(self.store, tenant_id)

    def _run(self, tenant_id: str, reads: int, timeout: float) -> dict[str, Any]:
        began = time.monotonic()
        # no dead entries of a former level's burst in the due index, fresh statistics
        bench_sizes.vacuum_analyze(self.store, "jobs")
        result: dict[str, Any] = {"vacuum_seconds": round(time.monotonic() - began, 1)}
        # run-history bytes: what the runs table grows by with this burst's runs, from a
        # compacted start (a former level's deleted runs would otherwise be counted)
        bench_sizes.compact(self.store, "runs")
        bytes_before = bench_sizes.table_bytes(self.store, "runs")
        runs_before = bench_sizes.row_count(self.store, "runs")
        empty, _ = self.due_reads(reads)  # nothing due in the window: the index descent only
        result["due_read_empty_window"] = _stats(empty)
        parked = self.store.now() + BURST_PARKED
        insert_once_jobs(self.store, tenant_id, [parked] * self.burst, name="scale-burst")
        # the burst inside the next window: the read the dispatcher makes before it fires
        bench_rows.move_jobs_due(self.store, tenant_id, self.store.now() + WINDOW / 2)
        full, rows = self.due_reads(max(1, reads // 4))
        result["due_read_burst_window"] = _stats(full) | {"rows": rows}
        due = self.store.now() + timedelta(seconds=self.lead)
        bench_rows.move_jobs_due(self.store, tenant_id, due)
        group = Dispatchers(self.url, 1, None, self.batch_size)
        group.start()
        pid = group.processes[0].pid
        peak = 0
        deadline = time.monotonic() + self.lead + timeout
        claimed, seen_all = 0, None
        try:
            while time.monotonic() < deadline and group.processes[0].poll() is None:
                peak = max(peak, measure.peak_rss_bytes(pid) or 0)
                try:
                    claimed = bench_rows.count_runs(self.store, tenant_id)
                except errors.StoreUnavailable:
                    # SQLite: locked while a claim holds the one write lock past the busy
                    # timeout; count again at the next tick
                    time.sleep(POLL_SECONDS)
                    continue
                if claimed >= self.burst:
                    seen_all = time.time()
                    break
                time.sleep(POLL_SECONDS)
            peak = max(peak, measure.peak_rss_bytes(pid) or 0)
        finally:
            exits = group.stop()
        times = [d for _, d in bench_rows.claim_times(self.store, tenant_id) if d is not None]
        # committed: when the bench first counted every run (the last claim transaction's
        # commit, to POLL_SECONDS); a run's dispatched_at is its claim transaction's start
        last = seen_all - due.timestamp() if seen_all is not None else None
        stamps = sorted(t.timestamp() for t in times)
        span = stamps[-1] - stamps[0] if len(stamps) > 1 else 0.0
        result.update(
            {
                "burst": self.burst,
                "claimed": len(times),
                "claimed_all_after_due_seconds": round(last, 3) if last is not None else None,
                "last_claim_started_after_due_seconds": (
                    round(stamps[-1] - due.timestamp(), 3) if stamps else None
                ),
                # the burst's claims over the time from its instant to the last commit
                "claims_per_second": round(len(times) / last, 1) if last and last > 0 else None,
                # between the first and the last claim transaction's start (the claim
                # loop's own pace; None when one transaction claimed them all)
                "claims_per_second_first_to_last": (
                    round((len(stamps) - 1) / span, 1) if span > 0 else None
                ),
                "dispatcher_peak_rss_bytes": peak,
                "dispatcher_exit": exits,
                "logs": str(group.logdir),
            }
        )
        grown = bench_sizes.table_bytes(self.store, "runs")
        rows = bench_sizes.row_count(self.store, "runs") - runs_before
        per_row = None
        if grown is not None and bytes_before is not None and rows > 0:
            per_row = round((grown - bytes_before) / rows, 1)
        result["bytes_per_run_row"] = per_row
        result["run_rows_measured"] = rows
        return result


def _job_bytes(store: Store) -> int | None:
    """Bytes of jobs and job_names (a job's name, copied there for the name search) with
    their indexes."""
    sizes = [bench_sizes.table_bytes(store, table) for table in ("jobs", "job_names")]
    return None if None in sizes else sum(size or 0 for size in sizes)


def _sizes(store: Store, before: dict[str, int | None]) -> dict[str, Any]:
    """Bytes per stored job: what the jobs and job_names tables and their indexes grew by
    since the empty start, over the rows jobs gained."""
    jobs_bytes = _job_bytes(store)
    jobs = bench_sizes.row_count(store, "jobs")
    start_bytes, start_rows = before["jobs_bytes"], before["jobs"] or 0
    per_job = None
    if jobs_bytes is not None and start_bytes is not None and jobs > start_rows:
        per_job = round((jobs_bytes - start_bytes) / (jobs - start_rows), 1)
    return {"jobs_stored": jobs, "jobs_bytes": jobs_bytes, "bytes_per_job": per_job}


def run_scale(
    store: Store,
    url: str,
    *,
    future_jobs: int,
    compare: int,
    burst: int,
    batch_size: int,
    lead: float,
    reads: int,
    timeout: float,
    keep: bool,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """The levels (`compare` then `future_jobs` future jobs stored; `compare` 0: only the
    one), each measured as _Level does, then the ratios of the bigger level to the smaller."""
    counts = sorted({c for c in (compare, future_jobs) if c > 0})
    before: dict[str, int | None] = {
        "jobs_bytes": _job_bytes(store),
        "jobs": bench_sizes.row_count(store, "jobs"),
    }
    tenant_id, _ = bench_tenant(store)
    spacing = FUTURE_SPAN / max(counts)
    first = store.now() + FUTURE_START
    levels: list[dict[str, Any]] = []
    loaded = 0
    try:
        say = progress or (lambda _: None)
        for count in counts:

            def told(done: int, base: int = loaded, end: int = count) -> None:
                if done % 1_000_000 == 0 or base + done == end:
                    say(f"loaded {base + done:,} future jobs")

            seconds = load_future_jobs(
                store,
                tenant_id,
                count - loaded,
                first_at=first + loaded * spacing,
                spacing=spacing,
                progress=told,
            )
            rate = round((count - loaded) / seconds, 1) if seconds > 0 else None
            loaded = count
            level: dict[str, Any] = {
                "future_jobs": count,
                "load_seconds": round(seconds, 1),
                "load_rows_per_second": rate,
            }
            level |= _sizes(store, before)
            say(f"measuring with {count:,} future jobs")
            level |= _Level(store, url, burst, batch_size, lead).run(reads, timeout)
            levels.append(level)
    finally:
        if not keep:
            bench_rows.delete_tenant(store, tenant_id)
    result: dict[str, Any] = {
        "benchmark": "scale",
        "dialect": bench_sizes.backend(store),
        "database": bench_rows.database_settings(store),
        "burst": burst,
        "batch_size": batch_size,
        "levels": levels,
    }
    if len(levels) == 2:
        small, big = levels
        result["ratios_big_to_small"] = {
            "claims_per_second": _ratio(big["claims_per_second"], small["claims_per_second"]),
            "due_read_empty_window_p50": _ratio(
                big["due_read_empty_window"]["p50_ms"], small["due_read_empty_window"]["p50_ms"]
            ),
            "due_read_burst_window_p50": _ratio(
                big["due_read_burst_window"]["p50_ms"], small["due_read_burst_window"]["p50_ms"]
            ),
            "dispatcher_peak_rss": _ratio(
                big["dispatcher_peak_rss_bytes"], small["dispatcher_peak_rss_bytes"]
            ),
            "bytes_per_job": _ratio(big["bytes_per_job"], small["bytes_per_job"]),
        }
    return result


def embedded_burst(store: Store, url: str, *, burst: int, lead: float, timeout: float) -> Any:
    """SQLite's figure: `burst` runs due at one instant through one `scheduled-d all` (the
    embedded default, no worker: a run is delivered once it is in the built-in queue), the
    whole-path burst of schedctl_bench.pipeline."""
    from schedctl_bench import pipeline

    plan = pipeline.Plan(
        target="queue",
        dispatchers=Dispatchers(url, 1, None, 10_000),
        workers=0,
        embedded=True,
        timeout=timeout,
    )
    result = pipeline.burst(store, plan, jobs=burst, lead_seconds=lead)
    return {
        "runs": burst,
        "claimed_after_due_seconds": result["claimed_after_due_seconds"],
        "delivered_after_due_seconds": result["delivered_after_due_seconds"],
        "complete": result["complete"],
        "missing": result["missing"],
        "duplicates": result["duplicates"],
        "peak_rss_bytes": result["peak_rss_bytes"],
        "exit_codes": result["exit_codes"],
    }
