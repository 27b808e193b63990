"""Owns the side-by-side benchmark behind `schedctl bench peers`: scheduled-d, procrastinate
and APScheduler 4 run the same burst (N jobs due at one instant) and the same steady load (R
jobs a second for S seconds) on the same Postgres server, each on a fresh database of its
own, in one run; for each, when its jobs started after their due instant (last, p50, p99),
and each peer's figure over scheduled-d's. scheduled-d's figures are its whole-path
benchmark's (schedctl_bench.pipeline: real dispatcher, relay and worker processes); the peers
run as plain scripts (schedctl_bench/peer_scripts/) under a virtual environment of their
own, made once with pip. Measured and reported, never asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib.metadata import version
from pathlib import Path
from typing import Any

from schedctl.core import errors
from schedctl_bench import children
from schedctl_bench.pipeline import lateness
from schedctl_bench.storage import scratch

PEERS = ("procrastinate", "apscheduler")
SYSTEMS = ("scheduled-d", *PEERS)
WORKLOADS = ("burst", "steady")
# what the peer venv gets; the stamp in the venv says which of these it has
REQUIREMENTS = (
    "procrastinate==3.10.0",
    "apscheduler[sqlalchemy]==4.0.0a6",
    "psycopg[binary]>=3.1",
    # apscheduler 4.0.0a6 imports it; anyio, which used to bring it, no longer does
    "sniffio",
)
SCRIPTS = Path(__file__).parent / "peer_scripts"
STAMP = "schedctl-peers.txt"
INSTALL_TIMEOUT_SECONDS = 900.0
STARTED = {
    "scheduled-d": "runs.started_at: the worker (scheduled-d worker, --worker-concurrency "
    "commands at once) leased the run and is starting its command, /bin/true; the run went "
    "through a dispatcher claim, the outbox, a relay and the built-in queue first",
    "procrastinate": "the task function (async: records time.time(), then runs /bin/true "
    "and waits for it) begins in the worker "
    "(run_worker_async, concurrency as --worker-concurrency, fetch polling 0.25 s, "
    "LISTEN/NOTIFY on)",
    "apscheduler": "the task function (async: records time.time(), then runs /bin/true and "
    "waits for it) begins in the "
    "AsyncScheduler (role both, max_concurrent_jobs as --worker-concurrency; "
    "SQLAlchemyDataStore over psycopg, PsycopgEventBroker)",
}

Runner = Callable[..., subprocess.CompletedProcess[str]]


@dataclass(frozen=True)
class Workloads:
    """The two workloads and their bounds, the same for every system."""

    jobs: int = 10_000
    rate: int = 200
    duration: float = 20.0
    lead: float = 20.0
    timeout: float = 120.0  # after the last due instant
    load_timeout: float = 600.0  # for loading a peer's jobs
    concurrency: int = 16

    def total(self, workload: str) -> int:
        return self.jobs if workload == "burst" else max(1, int(self.rate * self.duration))

    def peer_deadline(self, workload: str) -> float:
        """Seconds after which a peer's process is killed, whatever it reached."""
        span = self.duration if workload == "steady" else 0.0
        return self.load_timeout + self.lead + span + self.timeout + 120.0


# -- the peers' virtual environment ---------------------------------------------------------


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def venv_ready(venv: Path) -> bool:
    """The venv exists and has exactly REQUIREMENTS installed (by this module)."""
    stamp = venv / STAMP
    return (
        venv_python(venv).is_file()
        and stamp.is_file()
        and stamp.read_text().split("\n") == list(REQUIREMENTS)
    )


def ensure_venv(
    venv: Path, *, run: Runner = subprocess.run, say: Callable[[str], None] | None = None
) -> Path:
    """The peer venv's python: `python -m venv` and `pip install --pre REQUIREMENTS` the
    first time (or when the requirements changed), nothing after that."""
    if venv_ready(venv):
        return venv_python(venv)
    if say is not None:
        say(f"installing {', '.join(REQUIREMENTS)} into {venv}")
    if not venv_python(venv).is_file():
        _checked(run, [sys.executable, "-m", "venv", str(venv)], "creating the peer venv")
    _checked(
        run,
        [str(venv_python(venv)), "-m", "pip", "install", "--quiet", "--pre", *REQUIREMENTS],
        "installing the peers",
    )
    (venv / STAMP).write_text("\n".join(REQUIREMENTS))
    return venv_python(venv)


def _checked(run: Runner, argv: Sequence[str], what: str) -> None:
    try:
        done = run(
            list(argv),
            capture_output=True,
            text=True,
            timeout=INSTALL_TIMEOUT_SECONDS,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise errors.SchedError(f"{what} took over {INSTALL_TIMEOUT_SECONDS:.0f} s") from None
    if done.returncode != 0:
        tail = " | ".join((done.stderr or done.stdout or "").strip().splitlines()[-3:])
        raise errors.SchedError(f"{what} failed (exit {done.returncode}): {tail}")


# -- fresh databases on the given server ---------------------------------------------------


def scratch_name(system: str, workload: str) -> str:
    return f"bench_peers_{system.replace('-', '_')}_{workload}_{uuid.uuid4().hex[:8]}"


# -- figures ------------------------------------------------------------------------------


def figures(stage: dict[str, Any], total: int) -> dict[str, Any]:
    """last/p50/p99 of a {last, p50, p99, max, count} lateness, with how many started."""
    return {
        "last_s": stage.get("last"),
        "p50_s": stage.get("p50"),
        "p99_s": stage.get("p99"),
        "started": stage.get("count", 0),
        "of": total,
    }


def peer_figures(result: dict[str, Any]) -> dict[str, Any]:
    """A peer driver's result file as figures, from its (due, started) pairs."""
    pairs = [(datetime.fromtimestamp(due, UTC), started) for due, started in result["pairs"]]
    return figures(lateness(pairs), int(result["jobs"])) | {
        "version": result.get("version"),
        "load_seconds": result.get("load_seconds"),
        "complete": result.get("complete"),
        "error": result.get("error"),
        "settings": result.get("settings"),
    }


def ratios(by_system: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each peer's last/p50/p99 over scheduled-d's (above 1: the peer was later); from the
    jobs a peer started, so for one that did not start them all (and scheduled-d did) a
    lower bound, which `lower_bound` says."""
    base = by_system.get("scheduled-d", {})
    out: dict[str, dict[str, Any]] = {}
    for peer in PEERS:
        if peer not in by_system:
            continue
        row: dict[str, Any] = {
            "lower_bound": not by_system[peer].get("complete") and bool(base.get("complete"))
        }
        for key in ("last_s", "p50_s", "p99_s"):
            mine, theirs = by_system[peer].get(key), base.get(key)
            row[key.removesuffix("_s")] = (
                round(mine / theirs, 2)
                if isinstance(mine, int | float) and isinstance(theirs, int | float) and theirs > 0
                else None
            )
        out[peer] = row
    return out


# -- the runs -------------------------------------------------------------------------------


def run_scheduled_d(url: str, workload: str, w: Workloads) -> dict[str, Any]:
    """The whole-path benchmark on a fresh database: one dispatcher, one relay, one worker
    running /bin/true with w.concurrency commands at once."""
    from schedctl.storage.db.store import Store
    from schedctl_bench import pipeline
    from schedctl_bench.dispatch import Dispatchers

    rendered = url
    store = Store.open(rendered, upgrade=True)
    try:
        plan = pipeline.Plan(
            target="queue",
            dispatchers=Dispatchers(rendered, 1, None, 5000),
            relays=1,
            workers=1,
            worker_concurrency=w.concurrency,
            timeout=w.timeout,
        )
        if workload == "burst":
            result = pipeline.burst(store, plan, jobs=w.jobs, lead_seconds=w.lead)
        else:
            result = pipeline.steady(
                store, plan, rate=w.rate, duration=w.duration, lead_seconds=w.lead
            )
    finally:
        store.close()
    stages = {
        stage: {k: result[f"{stage}_after_due_seconds"][k] for k in ("last", "p50", "p99")}
        for stage in ("claimed", "delivered")
    }
    return figures(result["started_after_due_seconds"], w.total(workload)) | {
        "earlier_stages": stages,
        "dispatcher_started_before_first_due_seconds": result[
            "dispatchers_started_before_first_due_seconds"
        ],
        "version": version("schedctl"),
        "load_seconds": result["load_seconds"],
        "complete": result["complete"],
        "error": None if set(result["exit_codes"].values()) <= {0} else result["exit_codes"],
        "duplicates": result["duplicates"],
        "database": result["database"],
        "logs": result["logs"],
    }


def peer_argv(
    python: Path, system: str, dsn: str, workload: str, w: Workloads, out: Path
) -> list[str]:
    argv = [
        str(python),
        str(SCRIPTS / f"{system}_peer.py"),
        *("--dsn", dsn, "--workload", workload),
        *("--lead", str(w.lead), "--timeout", str(w.timeout)),
        *("--load-timeout", str(w.load_timeout), "--concurrency", str(w.concurrency)),
        "--out",
        str(out),
    ]
    if workload == "burst":
        return [*argv, "--jobs", str(w.jobs)]
    return [*argv, "--rate", str(w.rate), "--duration", str(w.duration)]


def run_peer(python: Path, system: str, url: str, workload: str, w: Workloads) -> dict[str, Any]:
    """One peer driver on a fresh database, killed after w.peer_deadline; its figures, or
    what went wrong."""
    logdir = Path(tempfile.mkdtemp(prefix=f"schedctl-peers-{system}-"))
    out = logdir / "result.json"
    argv = peer_argv(python, system, scratch.libpq_dsn(url), workload, w, out)
    with (logdir / "driver.log").open("wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        killed = False
        try:
            code: int | None = process.wait(w.peer_deadline(workload))
        except subprocess.TimeoutExpired:
            killed = True
            code = children.stop(process, 30)
    base: dict[str, Any] = {"logs": str(logdir), "exit_code": code}
    if not out.is_file():
        tail = (logdir / "driver.log").read_text(errors="replace").strip().splitlines()[-3:]
        return (
            figures({}, w.total(workload))
            | base
            | {
                "complete": False,
                "error": (
                    f"killed after {w.peer_deadline(workload):.0f} s"
                    if killed
                    else " | ".join(tail) or f"exit {code}"
                ),
            }
        )
    return peer_figures(json.loads(out.read_text())) | base


def run_peers(
    url: str,
    w: Workloads,
    *,
    python: Path | None,
    systems: Sequence[str] = SYSTEMS,
    say: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Each workload on each system, in turn, each on a fresh database of the server at
    `url`; the figures and each peer's ratio to scheduled-d. `python`: the peer venv's."""
    if scratch.backend(url) != "postgresql":
        raise errors.ValidationError("the peers run on Postgres: give a postgresql URL", field="db")
    result: dict[str, Any] = {
        "benchmark": "peers",
        "jobs": w.jobs,
        "rate_per_second": w.rate,
        "duration_seconds": w.duration,
        "lead_seconds": w.lead,
        "worker_concurrency": w.concurrency,
        "started_means": {s: STARTED[s] for s in systems},
        "load_average_before": [round(x, 2) for x in os.getloadavg()],
    }
    for workload in WORKLOADS:
        by_system: dict[str, dict[str, Any]] = {}
        for system in systems:
            if say is not None:
                say(f"{workload}: {system}")
            began = time.monotonic()
            with scratch.fresh_database(url, scratch_name(system, workload)) as db:
                if system == "scheduled-d":
                    by_system[system] = run_scheduled_d(db, workload, w)
                else:
                    assert python is not None
                    by_system[system] = run_peer(python, system, db, workload, w)
            by_system[system]["wall_seconds"] = round(time.monotonic() - began, 1)
            by_system[system]["load_average"] = [round(x, 2) for x in os.getloadavg()]
        result[workload] = by_system
        result[f"{workload}_ratio_to_scheduled_d"] = ratios(by_system)
    result["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    return result
