"""Owns the validated shape of a job file: FileJob, JobFile, where a job runs, its alerts, and
the errors that name file, line and key.

A FileJob holds everything its host needs to run it (command, user, environment); what goes
to the central store is only `job_body()` (schedule and limits) and `ref` (file + name):
commands never leave the host.
"""

from __future__ import annotations

import enum
import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from schedctl.core import errors

DEFAULT_SHELL = "/bin/sh"


class RunOnKind(enum.StrEnum):
    this_host = "this-host"
    host_group = "host-group"
    every_host = "every-host"


@dataclass(frozen=True)
class RunOn:
    """Where a job runs: the host whose file it is, one host of a group, or every live host
    (of a group, when given)."""

    kind: RunOnKind = RunOnKind.this_host
    group: str | None = None

    def __str__(self) -> str:
        return self.kind.value + (f":{self.group}" if self.group else "")


@dataclass(frozen=True)
class Alerts:
    """Validated alert targets (delivered by the alerting part, not here)."""

    email: tuple[str, ...] = ()
    webhook: tuple[str, ...] = ()
    command: tuple[str, ...] = ()
    on: tuple[str, ...] = ("dead_letter",)
    no_success_seconds: int | None = None

    @property
    def any(self) -> bool:
        return bool(self.email or self.webhook or self.command)

    def rest_body(self) -> dict[str, Any] | None:
        """The REST "alerts" object (schedctl.domain.alerts.model), None without a target. The
        alert command's argv stays on the host: centrally it is only `command: true` (the
        host's worker runs its own alert command). REST keeps one webhook: the first."""
        if not self.any:
            return None
        body: dict[str, Any] = {"on": list(self.on)}
        if self.email:
            body["email"] = list(self.email)
        if self.webhook:
            body["webhook"] = self.webhook[0]
        if self.command:
            body["command"] = True
        if self.no_success_seconds is not None:
            body["no_success"] = f"PT{self.no_success_seconds}S"
        return body


@dataclass(frozen=True)
class JobRef:
    """What the central store keeps instead of a command: the file and the job's name."""

    path: str
    name: str


@dataclass(frozen=True)
class FileJob:
    """One validated [[job]] table."""

    name: str
    path: Path
    line: int
    # the REST schedule object ({"cron", "timezone"} | {"every"} | {"run_at"}); None: @reboot
    # (dicts are left out of the hash, so that a FileJob can be a set member or a dict key)
    schedule: dict[str, Any] | None = field(hash=False)
    command: tuple[str, ...] | None = None
    shell: str | None = None
    shell_path: str = DEFAULT_SHELL
    stdin: str | None = None
    user: str | None = None
    group: str | None = None
    workdir: str | None = None
    env: tuple[tuple[str, str], ...] = ()
    # the limits in the REST shape, only those the file sets (timeout, retry, grace, ...)
    limits: dict[str, Any] = field(default_factory=dict, hash=False)
    run_on: RunOn = RunOn()
    # "central": the output's tail goes to the run history; "local": it stays on the host
    # (the daemon's log, i.e. the journal), the run history gets none
    output: str = "central"
    alerts: Alerts = Alerts()
    enabled: bool = True
    description: str | None = None
    # `after`: the names of jobs of the same directory this one runs after (no schedule of
    # its own; `schedctl apply` maps each to its central name)
    after: tuple[str, ...] = ()

    @property
    def is_boot(self) -> bool:
        """An @reboot job: run once per boot by its host's worker, no central schedule."""
        return self.schedule is None and not self.after

    @property
    def ref(self) -> JobRef:
        return JobRef(str(self.path), self.name)

    def argv(self) -> list[str]:
        """The command to execute: the argv list, or the shell line run by shell_path -c."""
        if self.command is not None:
            return list(self.command)
        return [self.shell_path, "-c", self.shell or ""]

    def job_body(self, queue: str, host: str | None = None) -> dict[str, Any]:
        """What `schedctl job create` / POST /v1/jobs takes for this job, sent to `queue`:
        schedule and limits, and as payload only the reference (file, name), never the
        command; with `host` (what `schedctl apply` sends) the payload also names the
        applying host and the digest (a command-only change is a changed payload), and the
        file's alerts come along. An @reboot job has no central schedule (its host's worker
        runs it). A dependent job (`after`) sends the names of its upstream jobs as they are
        in the files (`schedctl apply` maps them to central names)."""
        if self.is_boot and host is None:
            raise errors.ValidationError(
                f"job {self.name!r} runs at boot (@reboot) and has no central schedule",
                field="cron",
            )
        payload: dict[str, Any] = {"job_file": str(self.path), "job": self.name}
        if host is not None:
            payload.update(host=host, digest=self.digest())
            if not self.enabled:
                # apply's own pause: `enabled = true` later resumes it (an operator's stays)
                payload["disabled"] = True
        when: dict[str, Any] = (
            {"schedule": dict(self.schedule)}
            if self.schedule
            # an @reboot job, as `schedctl apply` makes it: a `boot` schedule, which the
            # dispatcher never fires; its host's worker records each boot run
            else {"schedule": {"boot": True}}
            if self.is_boot
            else {"after": list(self.after)}
        )
        body = {
            "name": self.name,
            **when,
            "target": {"type": "queue", "name": queue},
            "payload": payload,
            **self.limits,
        }
        alerts = self.alerts.rest_body() if host is not None else None
        if alerts is not None:
            body["alerts"] = alerts
        return body

    def digest(self) -> str:
        """A hash of the whole definition (command included, file and line not): what
        changed between two loads of the same job name."""
        data = asdict(self)
        data.pop("path")
        data.pop("line")
        # where the output goes is the host's alone: nothing central changes with it (and
        # the digests of the jobs applied before the key existed stay the same)
        data.pop("output")
        if not data["after"]:
            data.pop("after")  # the digests of jobs applied before `after` existed stay
        text = json.dumps(data, sort_keys=True, default=str, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class JobFile:
    """One *.toml file of the directory and the jobs it defines, in file order."""

    path: Path
    jobs: tuple[FileJob, ...]


@dataclass(frozen=True)
class Problem:
    """One refusal: the file, the line (None when the file cannot be read) and the key."""

    path: str
    line: int | None
    key: str
    message: str
    job: str | None = None

    def __str__(self) -> str:
        where = f"{self.path}:{self.line}" if self.line else self.path
        job = f" (job {self.job!r})" if self.job else ""
        # the project's form for configuration errors: "FIELD: FILE:LINE: problem"
        return f"{self.key}: {where}: {self.message}{job}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "file": self.path,
            "line": self.line,
            "key": self.key,
            "job": self.job,
            "message": self.message,
        }


class JobFilesError(errors.ConfigError):
    """One or more job files are invalid; nothing was loaded. `problems` lists each one."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = tuple(problems)
        first = problems[0]
        text = "\n".join(str(p) for p in problems)
        if len(problems) > 1:
            text = f"{len(problems)} problems in job files:\n{text}"
        super().__init__(text, field=None)
        self.field = first.key
