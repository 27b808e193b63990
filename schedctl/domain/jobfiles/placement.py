"""Owns where a job file's job lives in the central store: its central job name and the
built-in queue its runs go to, as seen from one host; and the queues a host's worker serves.

A host-group job is one central job (named as in the file) whose runs go to the group's
queue, so that any live host of the group takes each run once; every host applying the same
file converges on the same definition. A this-host or every-host job is one central job per
host (`NAME@HOST`) whose runs go to that host's own queue: each host has its own run key
(JOB_ID:SCHEDULED_AT of its own job) and its own run history. An every-host job with a group
is applied only on hosts of that group. A this-host job's queue is `host:HOST`, where runs
wait for the host's worker; an every-host job's is `every:HOST`, which a run reaches only
while the host's worker is live (else it is recorded skipped): one run per live host.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from schedctl.core import errors
from schedctl.domain.jobfiles.model import FileJob, RunOnKind
from schedctl.domain.models import EVERY_HOST_QUEUE_PREFIX

HOST_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}", re.ASCII)
HOST_QUEUE_PREFIX = "host:"
GROUP_QUEUE_PREFIX = "group:"
# what `schedctl apply` puts in a central job's payload: the reference, the applying host
# and the digest; plus `disabled: true` while the file says `enabled = false` (so that a
# later `enabled = true` resumes only a pause apply made, never an operator's)
APPLY_PAYLOAD_KEYS = frozenset({"job_file", "job", "host", "digest"})
DISABLED_KEY = "disabled"


def is_apply_payload(payload: object) -> bool:
    """Whether a central job's payload is exactly what `schedctl apply` sends."""
    if not isinstance(payload, dict):
        return False
    keys = set(payload)
    if keys == APPLY_PAYLOAD_KEYS:
        return True
    return keys == APPLY_PAYLOAD_KEYS | {DISABLED_KEY} and payload[DISABLED_KEY] is True


def check_host(host: str, field: str = "host") -> str:
    """A host name as queues and central names use it (1-63 of letters, digits, . _ -)."""
    if not HOST_NAME.fullmatch(host):
        raise errors.ConfigError(
            f"host name {host!r} must be 1-63 letters, digits and . _ - starting with a "
            "letter or digit",
            field=field,
        )
    return host


def host_queue(host: str) -> str:
    return HOST_QUEUE_PREFIX + check_host(host)


def every_host_queue(host: str) -> str:
    return EVERY_HOST_QUEUE_PREFIX + check_host(host)


def group_queue(group: str) -> str:
    return GROUP_QUEUE_PREFIX + group


def host_queues(host: str, groups: Iterable[str] = ()) -> list[str]:
    """The queues a host's worker serves: its own two (this-host, every-host), then one per
    group it belongs to."""
    return [
        host_queue(host),
        every_host_queue(host),
        *(group_queue(g) for g in sorted(set(groups))),
    ]


def central_name(job: FileJob, host: str) -> str:
    """The central job's name: the file's name for a host-group job, NAME@HOST otherwise."""
    if job.run_on.kind is RunOnKind.host_group:
        return job.name
    return f"{job.name}@{check_host(host)}"


def queue_for(job: FileJob, host: str) -> str:
    """The built-in queue the central job's runs go to."""
    if job.run_on.kind is RunOnKind.host_group:
        assert job.run_on.group is not None  # load refuses 'host-group' without a group
        return group_queue(job.run_on.group)
    if job.run_on.kind is RunOnKind.every_host:
        return every_host_queue(host)
    return host_queue(host)


def applies_to(job: FileJob, host: str, groups: Iterable[str] = ()) -> bool:
    """Whether applying the files on `host` (member of `groups`) defines this job: every job
    but an every-host job of a group the host is not in."""
    check_host(host)
    if job.run_on.kind is RunOnKind.every_host and job.run_on.group is not None:
        return job.run_on.group in set(groups)
    return True


def runs_here(job: FileJob, host: str, groups: Iterable[str] = ()) -> bool:
    """Whether `host` (member of `groups`) runs the job's runs (or, @reboot, runs it at its
    worker's start): a job it applies, but a host-group job only on the group's members
    (any host may apply one; its runs go to the group's queue)."""
    groups = set(groups)
    if job.run_on.kind is RunOnKind.host_group and job.run_on.group not in groups:
        return False
    return applies_to(job, host, groups)
