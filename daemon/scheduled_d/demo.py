"""`make demo`: the five-minute tour, run for real on the embedded default.

It creates a throwaway SQLite database, a tenant, a cron job, a one-time job and an
interval job with the real `schedctl` commands, starts `scheduled-d all` with a worker,
waits until each job has run, shows the run history, and stops the daemon with SIGTERM.
With SCHEDULED_DEMO_ONEFILE=PATH (set by `scheduled.pyz demo`) both commands are that one
file (`python3 PATH schedctl ...`), so the tour runs without the source tree or a venv.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BIN = Path(sys.executable).parent
ONEFILE_ENV = "SCHEDULED_DEMO_ONEFILE"
DEADLINE_SECONDS = 150.0

WORKER_SCRIPT = (
    'echo "job $SCHED_JOB_ID, run scheduled at $SCHED_SCHEDULED_AT, attempt $SCHED_ATTEMPT"; '
    'printf "payload: "; cat; echo'
)


def say(text: str) -> None:
    print(f"\n\033[1m== {text}\033[0m", flush=True)


def command(tool: str) -> list[str]:
    """How to start `schedctl` or `scheduled-d`: the one file if the demo runs from it
    (through this interpreter: the file's own #! may not name it), else the console script
    next to this interpreter."""
    onefile = os.environ.get(ONEFILE_ENV)
    if onefile:
        return [sys.executable, onefile, tool]
    return [str(BIN / tool)]


def schedctl(db: str, *args: str, show: bool = True) -> str:
    command_line = [*command("schedctl"), "--db", db, *args]
    if show:
        print("$ schedctl " + " ".join(shlex.quote(a) for a in args), flush=True)
    done = subprocess.run(command_line, capture_output=True, text=True, check=False, timeout=60)
    if done.returncode != 0:
        sys.stderr.write(done.stdout + done.stderr)
        raise SystemExit(f"schedctl {' '.join(args)} failed with exit code {done.returncode}")
    if show and "--output" not in args:
        print(done.stdout, end="", flush=True)
    return done.stdout


def create_job(db: str, *args: str) -> str:
    out = schedctl(db, "job", "create", "--tenant", "demo", *args, "--output", "json")
    job = json.loads(out)
    print(f"  -> job {job['job_id']}, next run at {job['next_run_at']}", flush=True)
    return str(job["job_id"])


def statuses(db: str, job_id: str) -> list[str]:
    runs = json.loads(schedctl(db, "runs", job_id, "--output", "json", show=False))
    items = runs["items"] if isinstance(runs, dict) else runs
    return [str(r["status"]) for r in items]


def main() -> int:
    workdir = Path(tempfile.mkdtemp(prefix="scheduled-demo-"))
    db = f"sqlite:///{workdir / 'scheduled.db'}"
    config = workdir / "scheduled.toml"
    config.write_text(
        "[[worker]]\n"
        'queue = "demo"\n'
        f"command = {json.dumps(['/bin/sh', '-c', WORKER_SCRIPT])}\n"
        "concurrency = 2\n"
    )
    say(f"A throwaway embedded database in {workdir}")
    schedctl(db, "db", "upgrade")
    say("A tenant (its API token is shown once)")
    schedctl(db, "tenant", "create", "demo")
    say("Three jobs: every minute by cron, once in 5 seconds, every 10 seconds")
    cron_job = create_job(
        db, "--cron", "* * * * *", "--tz", "Europe/Berlin", "--queue", "demo",
        "--payload", '{"report": "minutely"}', "--name", "minutely-report",
    )  # fmt: skip
    once_job = create_job(
        db, "--in", "5s", "--queue", "demo", "--payload", '{"greeting": "hello"}',
        "--name", "hello-once",
    )  # fmt: skip
    every_job = create_job(
        db, "--every", "10s", "--queue", "demo", "--payload", '{"tick": true}', "--name", "ticker"
    )
    schedctl(db, "job", "list")
    say("Starting `scheduled-d all` (dispatcher + relay + worker in one process)")
    log_path = workdir / "scheduled-d.log"
    with log_path.open("w") as log:
        daemon = subprocess.Popen(
            [*command("scheduled-d"), "all", "--db", db, "--config", str(config)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "SCHEDULED_LOG_LEVEL": "INFO"},
        )
    try:
        say("Waiting for each job to run (the cron job fires at the top of the minute)")
        deadline = time.monotonic() + DEADLINE_SECONDS
        done: set[str] = set()
        while time.monotonic() < deadline and len(done) < 3:
            for name, job_id in (("cron", cron_job), ("once", once_job), ("every", every_job)):
                if name not in done and "succeeded" in statuses(db, job_id):
                    done.add(name)
                    print(f"  {name} job has run", flush=True)
            if daemon.poll() is not None:
                break
            time.sleep(1.0)
        say("Run history")
        for job_id in (once_job, every_job, cron_job):
            schedctl(db, "runs", job_id, "--limit", "5")
        say("What the worker's command printed (kept in the run history)")
        for job_id in (once_job, cron_job):
            runs = json.loads(schedctl(db, "runs", job_id, "--output", "json", show=False))
            items = runs["items"] if isinstance(runs, dict) else runs
            if items:
                print((items[0].get("output_tail") or "").rstrip(), flush=True)
    finally:
        say("Stopping the daemon with SIGTERM (it finishes in-flight work first)")
        if daemon.poll() is None:
            daemon.send_signal(signal.SIGTERM)
        try:
            code = daemon.wait(timeout=60)
        except subprocess.TimeoutExpired:
            daemon.kill()
            code = daemon.wait()
        print(f"scheduled-d exited with code {code}; its log: {log_path}", flush=True)
    if len(done) < 3:
        print(f"demo FAILED: only {sorted(done)} ran; see {log_path}", file=sys.stderr)
        return 1
    say("Demo complete: a cron job, a one-time job and an interval job ran for real")
    return 0


if __name__ == "__main__":
    sys.exit(main())
