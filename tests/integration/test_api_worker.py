"""The tenant worker over the REST API (`scheduled-d worker --api URL`), on SQLite and a real
Postgres, against a real uvicorn serving the API: real worker processes whose environment has
no database URL run jobs end to end, and load no database code; kill -9 of one mid-run gets
the run redelivered after its lease expires; a cancel reaches the running command; a timeout
kills it. The lease routes themselves: another tenant's lease id (or a forged one) is 404 for
heartbeat, ack and fail, and the lease route returns only the caller's tenant's runs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import requests

from schedctl.app.service import Scheduler
from schedctl.clients.queue_client import ApiLeaseBackend
from schedctl.domain.leasing import CANCELLED_RUNNING_ERROR
from schedctl.storage.pipeline.queue import LOST_ERROR, QueueRepo
from scheduled_d.api.server import ApiServer
from scheduled_d.relay import Relay
from scheduled_d.worker import Worker
from tests.integration.queue_support import (
    attempts,
    end_processes,
    kill_when_started,
    messages,
    queue_job,
    run_row,
    running_loop,
    running_relay,
    trigger,
    wait_for,
)

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
LEASE = 2.0
HEARTBEAT = 0.5


@dataclass
class Tenant:
    tenant_id: str
    token: str
    token_id: str


@dataclass
class Env:
    sched: Scheduler
    url: str
    acme: Tenant
    other: Tenant

    def post(self, tenant: Tenant, path: str, body: Any = None) -> requests.Response:
        return requests.post(
            self.url + path,
            json=body,
            headers={"Authorization": f"Bearer {tenant.token}"},
            timeout=30,
        )


@pytest.fixture
def env(db_url: str) -> Iterator[Env]:
    sched = Scheduler.open(db_url)
    tenants = []
    for name in ("acme", "other"):
        tenant, token = sched.create_tenant(name, "test")
        tenants.append(Tenant(tenant.tenant_id, token, token.split("_")[1]))
    server = ApiServer(sched, "127.0.0.1:0", access_log=False)
    server.start()
    try:
        yield Env(sched, server.url, *tenants)
    finally:
        server.stop()
        sched.close()


def ready_run(env: Env, tenant: Tenant, **job: Any) -> tuple[str, datetime]:
    """A job of `tenant` on queue "q" (unless given) with one run waiting in the queue."""
    job_id = queue_job(env.sched.store, tenant=tenant.tenant_id, **job)
    at = trigger(env.sched.store, job_id)
    QueueRepo(env.sched.store).move_outbox()
    return job_id, at


def finished(env: Env, job: str, at: datetime) -> Callable[[], bool]:
    def check() -> bool:
        return run_row(env.sched.store, job, at)["status"] in {"succeeded", "failed", "dead"}

    return check


def worker_env(**extra: str) -> dict[str, str]:
    """The worker process's environment: the test's, without any database setting."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SCHEDULED_")}
    env.update(extra)
    return env


def outcome(
    env: Env, tenant: Tenant, lease_id: str, action: str, **extra: Any
) -> requests.Response:
    now = datetime.now(UTC).isoformat()
    body = {"exit_code": 0, "output_tail": "ok", "started_at": now, "finished_at": now, **extra}
    return env.post(tenant, f"/v1/leases/{lease_id}/{action}", body)


# -- real worker processes -----------------------------------------------------------------


def test_a_worker_process_without_database_settings_runs_jobs(env: Env, tmp_path: Path) -> None:
    payload = {"db": "orders", "note": "ünïcode"}
    job, at = ready_run(env, env.acme, payload=payload)
    seen = tmp_path / "seen.json"
    code = (
        "import json, os, sys\n"
        "env = {k: v for k, v in os.environ.items() if k.startswith('SCHED')}\n"
        "json.dump({'env': env, 'stdin': sys.stdin.read()}, open(sys.argv[1], 'w'))\n"
        "print('all done')\n"
    )
    token_file = tmp_path / "token"
    token_file.write_text(env.acme.token + "\n")
    result = subprocess.run(
        [
            str(BIN / "scheduled-d"),
            "worker",
            "--api",
            env.url,
            "--token-file",
            str(token_file),
            "--queue",
            "q",
            "--lease-seconds",
            "3",
            "--max-runs",
            "1",
            "--",
            sys.executable,
            "-c",
            code,
            str(seen),
        ],
        env=worker_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    got = json.loads(seen.read_text())
    assert json.loads(got["stdin"]) == payload
    assert got["env"]["SCHED_JOB_ID"] == job
    assert got["env"]["SCHED_ATTEMPT"] == "1"
    assert not any(k.startswith("SCHEDULED_") for k in got["env"])
    run = run_row(env.sched.store, job, at)
    assert (run["status"], run["exit_code"], run["error"]) == ("succeeded", 0, None)
    assert run["output_tail"].strip() == "all done"
    (attempt,) = attempts(env.sched.store, job, at)
    assert attempt["status"] == "succeeded"
    assert attempt["worker"].startswith(f"api:{env.acme.token_id}:")
    assert messages(env.sched.store) == []


def test_the_api_worker_loads_no_database_code(env: Env) -> None:
    job, at = ready_run(env, env.acme)
    probe = (
        "import atexit, sys\n"
        "atexit.register(lambda: print('DB-MODULES', sorted(m for m in sys.modules "
        "if m.split('.')[0] in {'sqlalchemy', 'psycopg', 'sqlite3', 'alembic'} "
        "or m.startswith('schedctl.storage')), file=sys.stderr))\n"
        "from scheduled_d.__main__ import main\n"
        "sys.argv = ['scheduled-d', 'worker', '--api', sys.argv[1], '--queue', 'q',\n"
        "            '--max-runs', '1', '--', 'true']\n"
        "main()\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe, env.url],
        env=worker_env(SCHEDULED_API_TOKEN=env.acme.token),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "DB-MODULES []" in result.stderr, result.stderr
    assert run_row(env.sched.store, job, at)["status"] == "succeeded"


def test_a_missing_or_rejected_token_is_a_clear_error(env: Env) -> None:
    result = subprocess.run(
        [str(BIN / "scheduled-d"), "worker", "--api", env.url, "--queue", "q", "--", "true"],
        env=worker_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "SCHEDULED_API_TOKEN" in result.stderr and "Traceback" not in result.stderr
    # a token the API rejects stops the worker: Unauthorized, exit code 6
    result = subprocess.run(
        [str(BIN / "scheduled-d"), "worker", "--api", env.url, "--queue", "q", "--", "true"],
        env=worker_env(SCHEDULED_API_TOKEN="st_nope_nope"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 6, result.stderr
    assert "401" in result.stderr and "Traceback" not in result.stderr


def test_an_api_worker_killed_mid_run_is_redelivered_after_its_lease(
    env: Env, tmp_path: Path
) -> None:
    store = env.sched.store
    job, at = ready_run(env, env.acme, max_attempts=3)
    started = tmp_path / "started"
    ran = tmp_path / "ran"
    # the first attempt hangs (its worker dies under it); later attempts succeed
    script = (
        f'if [ "$SCHED_ATTEMPT" = 1 ]; then echo $$ > {started}; exec sleep 1000; fi; '
        f'echo "$SCHED_ATTEMPT" >> {ran}'
    )
    argv = [
        str(BIN / "scheduled-d"), "worker", "--api", env.url, "--queue", "q",
        "--lease-seconds", str(LEASE), "--", "sh", "-c", script,
    ]  # fmt: skip
    doomed = subprocess.Popen(argv, env=worker_env(SCHEDULED_API_TOKEN=env.acme.token))
    rescuer: subprocess.Popen[bytes] | None = None
    orphan: int | None = None
    try:
        orphan = kill_when_started(doomed, started)
        (message,) = messages(store)
        assert message["lease_owner"].startswith(f"api:{env.acme.token_id}:")
        assert message["leased_until"] is not None, "the dead worker's lease is still held"
        # the killed worker's command lives on in its own session; end it
        os.killpg(orphan, signal.SIGKILL)
        # the relay reaps the expired lease; another API worker takes the redelivered run
        with running_relay(Relay(store, poll_seconds=0.05, reap_seconds=0.2)):
            rescuer = subprocess.Popen(
                [*argv[:-4], "--max-runs", "1", *argv[-4:]],
                env=worker_env(SCHEDULED_API_TOKEN=env.acme.token),
            )
            assert rescuer.wait(120) == 0
    finally:
        end_processes([doomed, rescuer], orphan)
    run = run_row(store, job, at)
    assert (run["status"], run["attempt"]) == ("succeeded", 2)
    history = attempts(store, job, at)
    assert [(a["attempt"], a["status"]) for a in history] == [(1, "lost"), (2, "succeeded")]
    assert history[0]["error"] == LOST_ERROR
    assert history[0]["worker"] != history[1]["worker"]
    assert ran.read_text().split() == ["2"]


# -- the shared supervision over the API backend (in-process worker) -----------------------


def run_api_worker(
    env: Env, tenant: Tenant, command: list[str], done: Callable[[], bool], what: str
) -> None:
    backend = ApiLeaseBackend(env.url, tenant.token, timeout=5.0)
    w = Worker(
        backend,
        "q",
        command,
        lease_seconds=LEASE,
        heartbeat_seconds=HEARTBEAT,
        poll_seconds=0.05,
        kill_grace_seconds=1.0,
    )
    try:
        with running_loop(w.run, "worker"):
            wait_for(done, what)
    finally:
        backend.close()


def test_heartbeats_keep_a_long_run_and_a_cancel_reaches_the_command(
    env: Env, tmp_path: Path
) -> None:
    job, at = ready_run(env, env.acme, max_attempts=3)
    started, stopped = tmp_path / "started", tmp_path / "stopped"
    # outlives several leases: only heartbeats through the API keep it
    script = (
        f"trap 'echo TERM > {stopped}; exit 143' TERM; touch {started}; "
        "i=0; while [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done"
    )

    cancelled = threading.Event()

    def cancel_when_running() -> bool:
        if not cancelled.is_set() and started.exists() and _held_for(env, job, at) > 2 * LEASE:
            env.sched.cancel_job(job, actor="test")
            cancelled.set()
        return cancelled.is_set() and finished(env, job, at)()

    run_api_worker(env, env.acme, ["sh", "-c", script], cancel_when_running, "the cancel")
    assert stopped.read_text().strip() == "TERM"
    run = run_row(env.sched.store, job, at)
    assert run["status"] == "failed"
    assert run["error"].startswith(CANCELLED_RUNNING_ERROR)
    (attempt,) = attempts(env.sched.store, job, at)  # not lost on the way, not retried
    assert attempt["status"] == "failed"
    assert messages(env.sched.store) == []


def _held_for(env: Env, job: str, at: datetime) -> float:
    started_at = run_row(env.sched.store, job, at)["started_at"]
    if started_at is None:
        return 0.0
    return (datetime.now(UTC) - started_at).total_seconds()


def test_timeout_kills_the_command_and_the_failure_is_recorded(env: Env) -> None:
    job, at = ready_run(env, env.acme, max_attempts=1, timeout=1)
    run_api_worker(
        env,
        env.acme,
        ["sh", "-c", "echo begun; exec sleep 1000"],
        finished(env, job, at),
        "the timeout",
    )
    run = run_row(env.sched.store, job, at)
    assert (run["status"], run["error"]) == ("dead", "timed out after 1s")
    assert run["output_tail"].strip() == "begun"


def test_nonzero_exit_is_retried_with_its_exit_code(env: Env) -> None:
    job, at = ready_run(env, env.acme, max_attempts=2)
    # the worker runs until the second attempt is dead-lettered: "failed" after the first
    # would stop it before the retry
    run_api_worker(
        env,
        env.acme,
        ["sh", "-c", "echo nope >&2; exit 3"],
        lambda: run_row(env.sched.store, job, at)["status"] == "dead",
        "the dead letter",
    )
    history = attempts(env.sched.store, job, at)
    assert [(a["attempt"], a["status"], a["exit_code"]) for a in history] == [
        (1, "failed", 3),
        (2, "failed", 3),
    ]
    assert history[0]["error"] == "exit code 3" and history[0]["output_tail"].strip() == "nope"


# -- the routes ----------------------------------------------------------------------------


def test_another_tenants_lease_id_is_404(env: Env) -> None:
    job, at = ready_run(env, env.acme)
    # the other tenant's queue of the same name is empty
    assert env.post(env.other, "/v1/queues/q/leases", {"limit": 10}).json() == {"items": []}
    response = env.post(env.acme, "/v1/queues/q/leases", {"limit": 10, "lease_seconds": 30})
    assert response.status_code == 200, response.text
    (lease,) = response.json()["items"]
    assert (lease["job_id"], lease["attempt"]) == (job, 1)
    lease_id = lease["lease_id"]
    message_id, secret = lease_id.split(".")
    forged = f"{message_id}.{'0' * len(secret)}"
    # the database (and so the run history) holds a digest of the secret, never the secret
    (message,) = messages(env.sched.store)
    assert message["lease_owner"].startswith(f"api:{env.acme.token_id}:")
    assert secret not in message["lease_owner"]
    for tenant, lid in (
        (env.other, lease_id),
        (env.acme, forged),
        (env.acme, "1"),
        (env.acme, "x"),
    ):
        beat = env.post(tenant, f"/v1/leases/{lid}/heartbeat", {"lease_seconds": 30})
        assert beat.status_code == 404, beat.text
        assert beat.json()["error"]["code"] == "not_found"
        assert outcome(env, tenant, lid, "ack").status_code == 404
        assert outcome(env, tenant, lid, "fail", error="x").status_code == 404
        assert outcome(env, tenant, lid, "fail", error="x", cancelled=True).status_code == 404
    # none of that touched the run
    assert run_row(env.sched.store, job, at)["status"] == "running"
    assert attempts(env.sched.store, job, at) == []
    beat = env.post(env.acme, f"/v1/leases/{lease_id}/heartbeat", {"lease_seconds": 30})
    assert beat.json() == {"status": "extended"}
    assert outcome(env, env.acme, lease_id, "ack").json() == {"status": "succeeded"}
    assert run_row(env.sched.store, job, at)["status"] == "succeeded"
    # settled: the lease is gone
    assert outcome(env, env.acme, lease_id, "ack").status_code == 404


def test_each_lease_of_one_call_has_its_own_secret(env: Env) -> None:
    runs = [ready_run(env, env.acme) for _ in range(3)]
    response = env.post(env.acme, "/v1/queues/q/leases", {"limit": 10, "lease_seconds": 30})
    assert response.status_code == 200, response.text
    leases = response.json()["items"]
    assert len(leases) == 3
    ids = [lease["lease_id"].split(".") for lease in leases]
    assert len({secret for _, secret in ids}) == 3
    assert all(len(secret) == 32 for _, secret in ids)  # 128 bits each
    # the database holds a different digest for each, never a secret
    owners = {m["id"]: m["lease_owner"] for m in messages(env.sched.store)}
    assert len(set(owners.values())) == 3
    assert not any(secret in owner for _, secret in ids for owner in owners.values())
    # one lease's secret with another's message id acts on nothing
    (_, first_secret), (second_id, _) = ids[0], ids[1]
    borrowed = f"{second_id}.{first_secret}"
    beat = env.post(env.acme, f"/v1/leases/{borrowed}/heartbeat", {"lease_seconds": 30})
    assert beat.status_code == 404, beat.text
    assert outcome(env, env.acme, borrowed, "ack").status_code == 404
    assert outcome(env, env.acme, borrowed, "fail", error="x").status_code == 404
    assert [run_row(env.sched.store, job, at)["status"] for job, at in runs] == ["running"] * 3
    # each lease's own id still settles it
    for lease in leases:
        assert outcome(env, env.acme, lease["lease_id"], "ack").json() == {"status": "succeeded"}
    assert [run_row(env.sched.store, job, at)["status"] for job, at in runs] == ["succeeded"] * 3


def test_text_no_database_can_hold_is_replaced_or_refused(env: Env) -> None:
    job, at = ready_run(env, env.acme, max_attempts=2)
    (lease,) = env.post(env.acme, "/v1/queues/q/leases", {}).json()["items"]
    now = datetime.now(UTC).isoformat()

    def fail(text: str) -> requests.Response:
        # JSON can spell NUL and unpaired surrogates; Postgres text and UTF-8 cannot hold them
        raw = (
            f'{{"exit_code": 1, "output_tail": "{text}", "error": "{text}", '
            f'"started_at": "{now}", "finished_at": "{now}"}}'
        )
        return requests.post(
            f"{env.url}/v1/leases/{lease['lease_id']}/fail",
            data=raw.encode(),
            headers={
                "Authorization": f"Bearer {env.acme.token}",
                "Content-Type": "application/json",
            },
            timeout=30,
        )

    refused = fail("a\\ud800b")
    assert refused.status_code == 422, refused.text
    assert attempts(env.sched.store, job, at) == []
    response = fail("a\\u0000b")
    assert response.json() == {"status": "failed"}, response.text
    (attempt,) = attempts(env.sched.store, job, at)
    assert attempt["output_tail"] == attempt["error"] == "a\ufffdb"
    assert run_row(env.sched.store, job, at)["status"] == "failed"  # retried later


def test_the_lease_route_returns_only_the_callers_runs(env: Env) -> None:
    mine, _ = ready_run(env, env.acme, max_concurrency=1)
    trigger(env.sched.store, mine)  # a second run of the same job: max_concurrency 1
    QueueRepo(env.sched.store).move_outbox()
    theirs, _ = ready_run(env, env.other)
    got = env.post(env.acme, "/v1/queues/q/leases", {"limit": 10}).json()["items"]
    assert [lease["job_id"] for lease in got] == [mine]
    assert env.post(env.acme, "/v1/queues/q/leases", {"limit": 10}).json() == {"items": []}
    got = env.post(env.other, "/v1/queues/q/leases", {}).json()["items"]
    assert [lease["job_id"] for lease in got] == [theirs]


def test_lease_route_validation(env: Env) -> None:
    for body in ({"limit": 0}, {"limit": 101}, {"lease_seconds": 0}, {"other": 1}, [1]):
        response = env.post(env.acme, "/v1/queues/q/leases", body)
        assert response.status_code == 422, (body, response.text)
    response = requests.post(env.url + "/v1/queues/q/leases", json={}, timeout=30)
    assert response.status_code == 401
