"""Owns what the peer drivers share (run by the peer venv's python, never imported by
schedctl): their command line, the due instants of a workload (all at one instant for a
burst, `rate` a second for a steady load) and the UPDATE that moves the loaded jobs to them,
the record of when each job started, and the result file `schedctl bench peers` reads:
{system, version, settings, load_seconds, jobs, pairs: [[due, started], ...] (unix
seconds), complete, reached, error}."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from importlib import metadata
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

FAR = timedelta(days=1)  # jobs are loaded this far ahead, then moved to their instants


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dsn", required=True, help="libpq connection string")
    parser.add_argument("--workload", choices=("burst", "steady"), required=True)
    parser.add_argument("--jobs", type=int, default=0, help="burst: jobs due at once")
    parser.add_argument("--rate", type=int, default=0, help="steady: jobs due a second")
    parser.add_argument("--duration", type=float, default=0.0, help="steady: seconds")
    parser.add_argument("--lead", type=float, default=10.0, help="load end to first due")
    parser.add_argument("--timeout", type=float, default=300.0, help="after the last due")
    parser.add_argument("--load-timeout", type=float, default=600.0, help="for the load")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--out", required=True, help="where the result JSON goes")
    return parser.parse_args()


def total(args: argparse.Namespace) -> int:
    if args.workload == "burst":
        return int(args.jobs)
    return max(1, int(args.rate * args.duration))


def due_offsets(args: argparse.Namespace) -> list[float]:
    """Seconds after the first due instant of each job, by index."""
    count = total(args)
    if args.workload == "burst":
        return [0.0] * count
    return [i / args.rate for i in range(count)]


def deadline(args: argparse.Namespace, first_due: float) -> float:
    """When the run gives up (unix): --timeout after the last due instant."""
    return first_due + max(due_offsets(args), default=0.0) + args.timeout


async def move_to_instants(args: argparse.Namespace, table: str, column: str, index: str) -> float:
    """Move every loaded job from far ahead to its due instant, `column` of `table`: all to
    the first instant, --lead seconds from now (a burst), or `rate` a second from it by the
    job's index, the SQL expression `index` (steady); the first due instant (unix)."""
    first = datetime.now(UTC) + timedelta(seconds=args.lead)
    rate = args.rate if args.workload == "steady" else 0
    target = {"table": sql.Identifier(table), "column": sql.Identifier(column)}
    async with await psycopg.AsyncConnection.connect(args.dsn) as connection:
        if rate:
            await connection.execute(
                sql.SQL(
                    "UPDATE {table} SET {column} = %s "
                    "+ ({index} / %s::float8) * interval '1 second'"
                ).format(index=sql.SQL(index), **target),
                (first, float(rate)),
            )
        else:
            await connection.execute(
                sql.SQL("UPDATE {table} SET {column} = %s").format(**target), (first,)
            )
    return first.timestamp()


class LoadTimeout(Exception):
    """The load took longer than --load-timeout: the run stops there."""


def check_load(args: argparse.Namespace, began: float, loaded: int) -> None:
    """Raise LoadTimeout once the load has taken longer than --load-timeout."""
    if time.monotonic() - began > args.load_timeout:
        raise LoadTimeout(f"the load did not finish in {args.load_timeout:g} s ({loaded} loaded)")


async def run_true() -> None:
    """The task's work: /bin/true in a child process, waited for."""
    process = await asyncio.create_subprocess_exec("/bin/true")
    await process.wait()


def far_instant() -> datetime:
    return datetime.now(UTC) + FAR


@dataclass
class Record:
    """When each job (by index) started, as the task itself saw it."""

    count: int
    started: dict[int, float] = field(default_factory=dict)

    def start(self, index: int) -> None:
        self.started.setdefault(index, time.time())

    def complete(self) -> bool:
        return len(self.started) >= self.count


@dataclass
class Outcome:
    """What a driver's run came to: the seconds its load took and the first due instant
    (unix), both None when it did not get there, and the error that stopped it."""

    record: Record
    load_seconds: float | None = None
    first_due: float | None = None
    error: str | None = None


def write(
    args: argparse.Namespace, outcome: Outcome, *, system: str, settings: dict[str, Any]
) -> None:
    """The result file of `system` (its installed version read here) run with `settings`."""
    record, first_due, load_seconds = outcome.record, outcome.first_due, outcome.load_seconds
    offsets = due_offsets(args)
    pairs = (
        [[first_due + offsets[i], at] for i, at in sorted(record.started.items())]
        if first_due is not None
        else []
    )
    result = {
        "system": system,
        "version": metadata.version(system),
        "settings": settings,
        "workload": args.workload,
        "jobs": record.count,
        "load_seconds": None if load_seconds is None else round(load_seconds, 3),
        "pairs": pairs,
        "complete": record.complete(),
        "reached": len(record.started),
        "error": outcome.error,
    }
    Path(args.out).write_text(json.dumps(result))
