"""Owns the APScheduler 4 side of `schedctl bench peers` (a plain script for the peer venv's
python, never imported by schedctl): an AsyncScheduler on a SQLAlchemyDataStore (async
psycopg engine) with a PsycopgEventBroker on a fresh database; adds one schedule per job
with a DateTrigger a day ahead, moves the schedules to their instants (an UPDATE of
next_fire_time, as the scheduled-d side moves its jobs), then runs the scheduler (role both:
it turns due schedules into jobs and runs them, max_concurrent_jobs as given) until every
task has started or the timeout; the task records when it started, then runs /bin/true (the
work a scheduled-d worker does per run). "Started" is the moment the task function begins in
the scheduler's async executor. The schedules are added ADD_AT_ONCE at a time (the load is
not measured, only bounded)."""

from __future__ import annotations

import asyncio
import time
import traceback

import peer_common
from apscheduler import AsyncScheduler, ConflictPolicy
from apscheduler.datastores.sqlalchemy import SQLAlchemyDataStore
from apscheduler.eventbrokers.psycopg import PsycopgEventBroker
from apscheduler.triggers.date import DateTrigger
from sqlalchemy.ext.asyncio import create_async_engine

ADD_AT_ONCE = 20  # concurrent add_schedule calls while loading (the engine's pool is 5+10)

args = peer_common.arguments()
record = peer_common.Record(peer_common.total(args))


async def bench_task(i: int) -> None:
    record.start(i)
    await peer_common.run_true()


def sqlalchemy_url(dsn: str) -> str:
    """host=... port=... user=... dbname=... as a SQLAlchemy psycopg URL."""
    parts = dict(item.split("=", 1) for item in dsn.split())
    return f"postgresql+psycopg://{parts['user']}@{parts['host']}:{parts['port']}/{parts['dbname']}"


async def main() -> None:
    outcome = peer_common.Outcome(record)
    engine = create_async_engine(sqlalchemy_url(args.dsn))
    try:
        store = SQLAlchemyDataStore(engine)
        broker = PsycopgEventBroker.from_async_sqla_engine(engine)
        began = time.monotonic()
        async with AsyncScheduler(store, broker, max_concurrent_jobs=args.concurrency) as s:
            far = peer_common.far_instant()
            for start in range(0, record.count, ADD_AT_ONCE):
                peer_common.check_load(args, began, start)
                await asyncio.gather(
                    *(
                        s.add_schedule(
                            bench_task,
                            DateTrigger(far),
                            id=f"b{i}",
                            args=(i,),
                            conflict_policy=ConflictPolicy.replace,
                        )
                        for i in range(start, min(record.count, start + ADD_AT_ONCE))
                    )
                )
        outcome.first_due = await peer_common.move_to_instants(
            args, "schedules", "next_fire_time", "substr(id, 2)::int"
        )
        outcome.load_seconds = time.monotonic() - began
        deadline = peer_common.deadline(args, outcome.first_due)
        async with AsyncScheduler(store, broker, max_concurrent_jobs=args.concurrency) as s:
            await s.start_in_background()
            while time.time() < deadline and not record.complete():
                await asyncio.sleep(0.05)
            await s.stop()
    except Exception:
        outcome.error = traceback.format_exc(limit=5)
    finally:
        await engine.dispose()
    peer_common.write(
        args,
        outcome,
        system="apscheduler",
        settings={
            "max_concurrent_jobs": args.concurrency,
            "data_store": "SQLAlchemyDataStore (psycopg async)",
            "event_broker": "PsycopgEventBroker",
        },
    )


asyncio.run(main())
