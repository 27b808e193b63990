"""The host worker over the REST API with a host token (the fleet's setup: no database URL
on a cron host), and the file winning on the host: a central job changed through the API
(timeout, max_concurrency, payload) does not change what the host runs, for how long, or
how many at once. Real API server, real database, real subprocesses; `scheduled-d worker
--api` as a process with no database URL in its environment or flags."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from schedctl.app.service import Scheduler
from schedctl.cli.app import app
from schedctl.clients.queue_client import ApiLeaseBackend
from schedctl.domain.alerts.model import parse_alerts
from schedctl.domain.config import HostConfig
from schedctl.storage.pipeline.queue import QueueRepo
from schedctl.storage.pipeline.workers import WorkerRepo
from schedctl.storage.records import alerts as alerts_repo
from scheduled_d.api.server import ApiServer
from scheduled_d.host_worker import HostWorker
from tests.integration.api_support import Api, snapshot
from tests.integration.queue_support import run_row, wait_for

BIN = Path(sys.executable).parent
HOST = "web1"


@pytest.fixture
def shared() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="hostapi-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def jobs(tmp_path: Path) -> Path:
    directory = tmp_path / "jobs.d"
    directory.mkdir()
    directory.chmod(0o755)
    return directory


@pytest.fixture
def host_api(sched: Scheduler, server: ApiServer, acme: Api) -> Api:
    return Api(server.url, sched.new_token("acme", actor="test", host=HOST, groups=["db"]))


def write_job(directory: Path, name: str, body: str) -> Path:
    path = directory / f"{name}.toml"
    path.write_text(f'[[job]]\nname = "{name}"\ncron = "0 3 * * *"\n{body}')
    path.chmod(0o644)
    return path


def applied(host_api: Api, path: Path, name: str, **more: Any) -> str:
    """The central job `schedctl apply` makes of it, made with the host token: its id."""
    body = {
        "name": f"{name}@{HOST}",
        "schedule": {"cron": "0 3 * * *"},
        "target": {"type": "queue", "name": f"host:{HOST}"},
        "payload": {"job_file": str(path), "job": name, "host": HOST, "digest": "0" * 64},
        **more,
    }
    job_id: str = host_api.new_job(body)["job_id"]
    return job_id


def run_now(sched: Scheduler, tenant: Api, job_id: str) -> datetime:
    """A manual run through the tenant's token, moved into its queue: its scheduled_at."""
    response = tenant.request("POST", f"/v1/jobs/{job_id}/trigger")
    assert response.status_code == 202, response.text
    QueueRepo(sched.store).move_outbox()
    return datetime.fromisoformat(response.json()["scheduled_at"].replace("Z", "+00:00"))


def host_worker(server: ApiServer, host_api: Api, jobs: Path, **options: Any) -> HostWorker:
    backend = ApiLeaseBackend(server.url, host_api.token, timeout=10.0)
    return HostWorker(
        backend,
        HostConfig(
            name=HOST,
            groups=("db",),
            jobs_dir=str(jobs),
            **{"state_dir": str(jobs.parent / "state"), **options},
        ),
        lease_seconds=5.0,
        heartbeat_seconds=0.5,
        poll_seconds=0.1,
    )


def test_the_host_worker_leases_runs_and_settles_over_the_api(
    sched: Scheduler, server: ApiServer, acme: Api, host_api: Api, jobs: Path, shared: Path
) -> None:
    out = shared / "out"
    path = write_job(jobs, "report", f'shell = "echo ran > {out}"\n')
    job_id = applied(host_api, path, "report")
    at = run_now(sched, acme, job_id)
    worker = host_worker(server, host_api, jobs)
    assert worker.run(threading.Event(), idle_exit=True) == 1
    assert out.read_text() == "ran\n"
    assert run_row(sched.store, job_id, at)["status"] == "succeeded"
    live = WorkerRepo(sched.store).live()
    tenant_id = sched.get_tenant("acme").tenant_id
    assert live[(tenant_id, f"host:{HOST}")] == (f"api:{host_api.token_id}",)


def test_the_file_s_timeout_wins_over_the_central_job_s(
    sched: Scheduler, server: ApiServer, acme: Api, host_api: Api, jobs: Path
) -> None:
    # the command would outlive the test's patience only if the central timeout ruled
    path = write_job(jobs, "slow", 'shell = "sleep 120"\ntimeout = "PT1S"\n')
    job_id = applied(host_api, path, "slow", timeout="PT1S", retry={"max_attempts": 1})
    changed = acme.request("PATCH", f"/v1/jobs/{job_id}", json={"timeout": 3600})
    assert changed.status_code == 200 and changed.json()["timeout_seconds"] == 3600
    at = run_now(sched, acme, job_id)
    assert host_worker(server, host_api, jobs).run(threading.Event(), idle_exit=True) == 1
    row = run_row(sched.store, job_id, at)
    assert row["status"] in ("failed", "dead"), row
    assert row["error"] == "timed out after 1s"


def test_the_file_s_max_concurrency_wins_over_the_central_job_s(
    sched: Scheduler, server: ApiServer, acme: Api, host_api: Api, jobs: Path, shared: Path
) -> None:
    started, go = shared / "started", shared / "go"
    wait_go = (
        f"touch {started}; i=0; "
        f"while [ ! -e {go} ] && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done"
    )
    path = write_job(jobs, "once", f"shell = {json.dumps(wait_go)}\n")  # max_concurrency 1
    job_id = applied(host_api, path, "once", retry={"max_attempts": 1})
    changed = acme.request("PATCH", f"/v1/jobs/{job_id}", json={"max_concurrency": 5})
    assert changed.status_code == 200 and changed.json()["max_concurrency"] == 5
    worker = host_worker(server, host_api, jobs)
    stop = threading.Event()
    thread = threading.Thread(target=worker.run, args=(stop,), daemon=True)
    thread.start()
    try:
        first = run_now(sched, acme, job_id)
        wait_for(started.exists, "the first run to start")
        second = run_now(sched, acme, job_id)
        wait_for(
            lambda: run_row(sched.store, job_id, second)["status"] in ("failed", "dead"),
            "the second run to be refused",
        )
        row = run_row(sched.store, job_id, second)
        assert "its file's max_concurrency is 1" in str(row["error"]), row
        go.touch()
        wait_for(
            lambda: run_row(sched.store, job_id, first)["status"] == "succeeded",
            "the first run to succeed",
        )
    finally:
        go.touch()
        stop.set()
        thread.join(60)
    assert not thread.is_alive()


def test_the_central_payload_never_reaches_the_command_s_stdin(
    sched: Scheduler, server: ApiServer, acme: Api, host_api: Api, jobs: Path, shared: Path
) -> None:
    out = shared / "stdin"
    path = write_job(jobs, "reads", f'command = ["/bin/sh", "-c", "cat > {out}"]\n')
    job_id = applied(host_api, path, "reads")
    payload = {"job_file": str(path), "job": "reads", "host": HOST, "digest": "0" * 64}
    changed = acme.request(
        "PATCH", f"/v1/jobs/{job_id}", json={"payload": {**payload, "input": "INJECTED"}}
    )
    assert changed.status_code == 200, changed.text
    at = run_now(sched, acme, job_id)
    assert host_worker(server, host_api, jobs).run(threading.Event(), idle_exit=True) == 1
    assert run_row(sched.store, job_id, at)["status"] == "succeeded"
    assert json.loads(out.read_text()) == {"job_file": str(path), "job": "reads"}


def worker_process(
    server: ApiServer, token: str, jobs: Path, *more: str
) -> subprocess.CompletedProcess[str]:
    """`scheduled-d worker --api` as a cron host runs it: no database URL anywhere."""
    env = {"PATH": os.environ["PATH"], "SCHEDULED_API_TOKEN": token}
    return subprocess.run(
        [BIN / "scheduled-d", "worker", "--api", server.url, "--jobs-dir", str(jobs), *more],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_scheduled_d_worker_api_runs_the_host_s_jobs_without_a_database_url(
    sched: Scheduler, server: ApiServer, acme: Api, host_api: Api, jobs: Path, shared: Path
) -> None:
    out = shared / "out"
    path = write_job(jobs, "nightly", f'shell = "echo done > {out}"\n')
    job_id = applied(host_api, path, "nightly")
    at = run_now(sched, acme, job_id)
    result = worker_process(
        server, host_api.token, jobs, "--host", HOST, "--group", "db", "--max-runs", "1"
    )
    assert result.returncode == 0, result.stderr
    assert out.read_text() == "done\n"
    assert run_row(sched.store, job_id, at)["status"] == "succeeded"


def test_the_host_worker_refuses_another_host_s_token(
    sched: Scheduler, server: ApiServer, acme: Api, host_api: Api, jobs: Path
) -> None:
    web2 = sched.new_token("acme", actor="test", host="web2")
    result = worker_process(server, web2, jobs, "--host", HOST, "--max-runs", "1")
    assert result.returncode == 2, result.stderr
    assert "host token of host 'web2'" in result.stderr
    result = worker_process(
        server, host_api.token, jobs, "--host", HOST, "--group", "ops", "--max-runs", "1"
    )
    assert result.returncode == 2, result.stderr
    assert "does not serve group(s) ops" in result.stderr
    result = worker_process(server, host_api.token, jobs, "--host", HOST, "--db", "sqlite://")
    assert result.returncode == 2, result.stderr
    assert "--api and --db exclude each other" in result.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="runs the alert command as nobody: root")
def test_a_dead_letter_runs_the_job_file_s_alert_command_over_the_api(
    sched: Scheduler, server: ApiServer, acme: Api, host_api: Api, jobs: Path, shared: Path
) -> None:
    """`alert_command` of a job file, applied over the API with the host token: the host
    worker over the API leases the command alert, runs the file's command with the alert
    on stdin and finishes it; a job whose file has no alert_command runs nothing."""
    shared.chmod(0o777)  # the alert command writes here as nobody
    marker = shared / "alert.json"
    failing = 'command = ["/bin/false"]\nretry = { max_attempts = 1 }\n'
    noisy = f"cat > {marker}; id -u > {marker}.uid"
    write_job(
        jobs,
        "noisy",
        failing + f'user = "nobody"\nalert_command = ["/bin/sh", "-c", "{noisy}"]\n',
    )
    write_job(jobs, "silent", failing + 'alert_email = ["ops@example.com"]\n')
    result = CliRunner().invoke(
        app,
        ["--api", server.url, "--token", host_api.token, "apply", str(jobs), "--host", HOST,
         "--group", "db"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    ids = {j["name"]: j["job_id"] for j in acme.request("GET", "/v1/jobs").json()["items"]}
    # the silent job's command alert is the tenant's default: its file has no command
    alerts_repo.set_settings(
        sched.store, sched.get_tenant("acme").tenant_id, ids["silent@web1"],
        parse_alerts({"command": True}),
    )  # fmt: skip
    runs = {name: run_now(sched, acme, job_id) for name, job_id in ids.items()}

    def alert_of(name: str) -> dict[str, Any]:
        (row,) = [a for a in alerts_repo.list_alerts(sched.store) if a["job_id"] == ids[name]]
        return row

    worker = host_worker(server, host_api, jobs)
    stop = threading.Event()
    thread = threading.Thread(target=worker.run, args=(stop,), daemon=True)
    thread.start()
    try:
        for name, at in runs.items():
            wait_for(
                lambda n=name, a=at: run_row(sched.store, ids[n], a)["status"] == "dead",
                "the dead letter",
            )
        wait_for(lambda: alert_of("noisy@web1")["status"] == "delivered", "the alert command")
        wait_for(lambda: alert_of("silent@web1")["last_error"] is not None, "the refusal")
    finally:
        stop.set()
        thread.join(60)
    assert not thread.is_alive()
    alert = json.loads(marker.read_text())
    assert (alert["alert"], alert["job_id"]) == ("dead_letter", ids["noisy@web1"])
    silent = alert_of("silent@web1")
    assert (silent["status"], silent["lease_owner"]) == ("pending", None)
    assert "has no alert_command on this host" in silent["last_error"]
    # as the job's user, as its runs (not as the worker's root)
    assert int(Path(f"{marker}.uid").read_text()) == pwd.getpwnam("nobody").pw_uid
    assert sorted(p.name for p in shared.iterdir()) == ["alert.json", "alert.json.uid"]


def test_boot_runs_are_recorded_over_the_api_once_per_boot(
    sched: Scheduler, server: ApiServer, acme: Api, host_api: Api, jobs: Path, tmp_path: Path
) -> None:
    path = jobs / "boot.toml"
    path.write_text('[[job]]\nname = "warm"\ncron = "@reboot"\nshell = "echo warm-out; exit 4"\n')
    path.chmod(0o644)
    # the central job as `schedctl apply` makes it, with the host token
    body = {
        "name": f"warm@{HOST}",
        "schedule": {"boot": True},
        "target": {"type": "queue", "name": f"host:{HOST}"},
        "payload": {"job_file": str(path), "job": "warm", "host": HOST, "digest": "0" * 64},
    }
    job_id = host_api.new_job(body)["job_id"]
    boot_id = tmp_path / "boot_id"
    boot_id.write_text("33333333-aaaa-4bbb-8ccc-000000000001\n")

    def history() -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = acme.request("GET", f"/v1/jobs/{job_id}/runs").json()["items"]
        return items

    for _ in range(2):  # two worker processes in one boot: one boot run
        host_worker(server, host_api, jobs, boot_id_file=str(boot_id)).run(
            threading.Event(), idle_exit=True
        )
        wait_for(lambda: len(history()) == 1, "the boot run")
    (run,) = history()
    assert (run["trigger"], run["status"], run["exit_code"]) == ("boot", "failed", 4)
    assert run["output_tail"] == "warm-out\n" and run["error"] == "exit code 4"
    boot_id.write_text("33333333-aaaa-4bbb-8ccc-000000000002\n")
    host_worker(server, host_api, jobs, boot_id_file=str(boot_id)).run(
        threading.Event(), idle_exit=True
    )
    wait_for(lambda: len(history()) == 2, "the next boot's run")


def test_a_host_token_records_boot_runs_of_its_own_boot_jobs_only(
    sched: Scheduler, server: ApiServer, acme: Api, host_api: Api
) -> None:
    other = Api(server.url, sched.new_token("acme", actor="test", host="web9"))
    mine = {
        "name": f"warm@{HOST}",
        "schedule": {"boot": True},
        "target": {"type": "queue", "name": f"host:{HOST}"},
        "payload": {"job_file": "/etc/x.toml", "job": "warm", "host": HOST, "digest": "0" * 64},
    }
    host_api.new_job(mine)
    cron = {**mine, "name": f"cron@{HOST}", "schedule": {"cron": "0 3 * * *"}}
    cron["payload"] = {**mine["payload"], "job": "cron"}
    host_api.new_job(cron)
    before = snapshot(sched.store)
    for api, name, status, field in (
        (other, f"warm@{HOST}", 404, "job"),  # another host's: as if it did not exist
        (host_api, "nope", 404, "job"),
        (host_api, f"cron@{HOST}", 422, "job"),  # no @reboot job
        (host_api, f"warm@{HOST}", 422, "seconds"),
    ):
        seconds = -1 if field == "seconds" else 1
        answer = api.request("POST", "/v1/boot-runs", json={"job": name, "seconds": seconds})
        assert answer.status_code == status, answer.text
        assert answer.json()["error"]["field"] == field, answer.text
    assert snapshot(sched.store) == before
    made = host_api.request("POST", "/v1/boot-runs", json={"job": f"warm@{HOST}", "seconds": 2})
    assert made.status_code == 201 and made.json()["status"] == "failed", made.text
    ok = {"job": f"warm@{HOST}", "seconds": 1, "exit_code": 0, "output": "fine\n"}
    made = host_api.request("POST", "/v1/boot-runs", json=ok)
    assert made.status_code == 201 and made.json()["status"] == "succeeded", made.text


def test_the_worker_reports_its_drift_over_the_api_with_its_host_token(
    sched: Scheduler, server: ApiServer, acme: Api, host_api: Api, jobs: Path
) -> None:
    from schedctl.storage.jobs import host_drift

    write_job(jobs, "report", 'shell = "echo v1"\n')
    worker = host_worker(server, host_api, jobs)
    assert worker.check_drift() == [f"created report@{HOST}"]
    tenant_id = sched.get_tenant("acme").tenant_id
    (row,) = host_drift.read(sched.store)
    assert (row.tenant_id, row.host, row.drift) == (tenant_id, HOST, (f"created report@{HOST}",))
    code, out = apply_with(server, host_api, jobs)
    assert code == 0, out
    assert worker.check_drift() == []
    (row,) = host_drift.read(sched.store)
    assert row.drift == ()
    # only a host token reports drift, and only its own host's
    refused = acme.request("POST", "/v1/host-drift", json={"drift": []})
    assert refused.status_code == 403, refused.text
    bad = host_api.request("POST", "/v1/host-drift", json={"drift": "x"})
    assert bad.status_code == 422 and bad.json()["error"]["field"] == "drift", bad.text


def apply_with(server: ApiServer, host_api: Api, jobs: Path) -> tuple[int, str]:
    result = CliRunner().invoke(
        app,
        ["--api", server.url, "--token", host_api.token, "apply", str(jobs), "--host", HOST,
         "--group", "db"],
    )  # fmt: skip
    return result.exit_code, result.output
