"""Owns the host-command alert channel (like systemd's OnFailure=): a worker of a queue
runs its operator-configured `alert_command` once per alert of that queue's jobs, with the
alert JSON on stdin. The command comes from the host's configuration, never the alert."""

from __future__ import annotations

import json
import logging
import os
import subprocess
from collections.abc import Sequence

from schedctl.alerts.model import COMMAND
from schedctl.storage import alerts as repo
from schedctl.storage.store import Store

log = logging.getLogger("schedctl.alerts")

BATCH = 10  # alerts run per call
TIMEOUT_SECONDS = 60.0  # one alert command's deadline; then it is killed and retried
LEASE_SECONDS = TIMEOUT_SECONDS + 30.0
_INHERITED = ("PATH", "LANG", "TZ", "HOME")


def run_alert_commands(
    store: Store,
    *,
    tenant_id: str,
    queue: str,
    command: Sequence[str],
    owner: str,
    timeout: float = TIMEOUT_SECONDS,
) -> int:
    """Run `command` for each due command alert of (tenant, queue); returns how many ran.
    A non-zero exit, a timeout or a command that cannot start is retried later."""
    leased = repo.claim(
        store,
        (COMMAND,),
        f"{owner}:alerts",
        limit=BATCH,
        lease_seconds=max(LEASE_SECONDS, timeout + 30.0),
        destination=queue,
        tenant_id=tenant_id,
    )
    env = {name: os.environ[name] for name in _INHERITED if name in os.environ}
    for alert in leased:
        env.update(SCHED_ALERT=alert.kind, SCHED_JOB_ID=alert.job_id)
        error: str | None = None
        try:
            done = subprocess.run(
                list(command),
                input=json.dumps(alert.body, sort_keys=True).encode(),
                capture_output=True,
                timeout=timeout,
                env=env,
                check=False,
            )
            if done.returncode != 0:
                tail = done.stderr.decode(errors="replace")[-500:]
                error = f"alert command exited with {done.returncode}: {tail}"
        except subprocess.TimeoutExpired:
            error = f"alert command timed out after {timeout:g} s"
        except OSError as exc:
            error = f"alert command could not start: {exc}"
        if error is not None:
            log.warning("alerts: command alert of job %s failed: %s", alert.job_id, error)
        repo.finish(store, f"{owner}:alerts", alert, error)
    return len(leased)
