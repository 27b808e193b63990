"""Owns the procrastinate side of `schedctl bench peers` (a plain script for the peer venv's
python, never imported by schedctl): applies procrastinate's schema to a fresh database,
defers the workload's jobs a day ahead (batch_defer_async with schedule_at), moves them to
their instants (an UPDATE of scheduled_at, as the scheduled-d side moves its jobs), runs one
worker (run_worker_async, concurrency as given) whose task records when it started and then
runs /bin/true (the work a scheduled-d worker does per run), and writes the result file.
"Started" is the moment the task function begins in the worker."""

from __future__ import annotations

import asyncio
import contextlib
import time
import traceback

import peer_common
import procrastinate

POLL_SECONDS = 0.25  # fetch_job_polling_interval (procrastinate's default is 5 s)
DEFER_CHUNK = 1000

args = peer_common.arguments()
record = peer_common.Record(peer_common.total(args))
app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=args.dsn))


@app.task(name="bench_task")
async def bench_task(i: int) -> None:
    record.start(i)
    await peer_common.run_true()


async def load(began: float) -> float:
    """Defer every job a day ahead, then move them; the first due instant (unix)."""
    await app.schema_manager.apply_schema_async()
    far = peer_common.far_instant()
    deferrer = bench_task.configure(schedule_at=far)
    for start in range(0, record.count, DEFER_CHUNK):
        peer_common.check_load(args, began, start)
        end = min(record.count, start + DEFER_CHUNK)
        await deferrer.batch_defer_async(*({"i": i} for i in range(start, end)))
    return await peer_common.move_to_instants(
        args, "procrastinate_jobs", "scheduled_at", "(args->>'i')::int"
    )


async def main() -> None:
    outcome = peer_common.Outcome(record)
    try:
        async with app.open_async():
            began = time.monotonic()
            outcome.first_due = await load(began)
            outcome.load_seconds = time.monotonic() - began
            worker = asyncio.create_task(
                app.run_worker_async(
                    concurrency=args.concurrency,
                    install_signal_handlers=False,
                    fetch_job_polling_interval=POLL_SECONDS,
                    delete_jobs="never",
                )
            )
            deadline = peer_common.deadline(args, outcome.first_due)
            while time.time() < deadline and not record.complete() and not worker.done():
                await asyncio.sleep(0.05)
            if worker.done() and worker.exception() is not None:
                outcome.error = repr(worker.exception())
            worker.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(worker, 30)
    except Exception:
        outcome.error = traceback.format_exc(limit=5)
    peer_common.write(
        args,
        outcome,
        system="procrastinate",
        settings={
            "concurrency": args.concurrency,
            "fetch_job_polling_interval": POLL_SECONDS,
            "listen_notify": True,
        },
    )


asyncio.run(main())
