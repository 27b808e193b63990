"""Owns what a host token may touch: the HostScope of a token made by `schedctl tenant token
create TENANT --host H [--group G]...`, its queues, and which central jobs are that host's.

A cron host holds only such a token (no database URL). With it, the API lets the host
lease and settle runs of its own queues (host:H, every:H, group:G of its groups), and
read, create, change and remove only the central jobs its own files define, as
`schedctl apply` on that host makes them (schedctl.app.jobfiles_apply): a job of one of its
queues whose payload is exactly apply's reference {job_file, job, host, digest}, applied by
this host (a this-host or every-host job is NAME@H with payload host H; a host-group job
is shared by the group's hosts, any of which applies it). Another host's job, or one a
tenant token made by hand, is not this host's: 404, as if it did not exist. Nothing else
of the API is open to a host token (scheduled_d.api.host_routes).

Pure functions over plain values: no database, so the API and the tests share them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from schedctl.core import errors
from schedctl.domain.jobfiles import placement

if TYPE_CHECKING:
    from schedctl.domain.models import Job

# what a create or update body of a host token may hold: what apply sends, nothing more
# (`after` naming only the host's own jobs: check_after; no idempotency key)
HOST_BODY_KEYS = frozenset(
    {
        "name",
        "schedule",
        "after",
        "target",
        "payload",
        "alerts",
        "start",
        "end",
        "timeout",
        "retry",
        "misfire_policy",
        "grace",
        "window",
        "max_concurrency",
    }
)
MAX_GROUPS = 100


@dataclass(frozen=True)
class HostScope:
    """A host token's host and the host groups it serves."""

    host: str
    groups: tuple[str, ...] = ()

    @classmethod
    def make(cls, host: str, groups: Iterable[str] = ()) -> HostScope:
        """Checked as queue names use them (ValidationError naming host or group)."""
        shape = "1-63 letters, digits and . _ - starting with a letter or digit"
        if not isinstance(host, str) or not placement.HOST_NAME.fullmatch(host):
            raise errors.ValidationError(f"must be {shape}, got {host!r}", field="host")
        found = tuple(sorted(set(groups)))
        if len(found) > MAX_GROUPS:
            raise errors.ValidationError(f"at most {MAX_GROUPS} groups", field="group")
        for group in found:
            if not isinstance(group, str) or not placement.HOST_NAME.fullmatch(group):
                raise errors.ValidationError(f"must be {shape}, got {group!r}", field="group")
        return cls(host, found)

    @classmethod
    def from_columns(cls, host: str | None, groups: str | None) -> HostScope | None:
        """The scope stored with a token (api_tokens.host, .groups); None: a tenant token."""
        if host is None:
            return None
        names = json.loads(groups) if groups else []
        return cls(host, tuple(str(g) for g in names))

    def groups_column(self) -> str:
        return json.dumps(list(self.groups))

    @property
    def queues(self) -> list[str]:
        return placement.host_queues(self.host, self.groups)

    def allows_queue(self, queue: str) -> bool:
        return queue in self.queues

    def check_queue(self, queue: str) -> None:
        """Forbidden unless `queue` is one of this host's."""
        if not self.allows_queue(queue):
            raise errors.Forbidden(
                f"this host token (host {self.host}) serves only the queues "
                f"{', '.join(self.queues)}",
                field="name",
            )

    # -- central jobs --------------------------------------------------------------------

    def owns(self, name: str, target: Mapping[str, Any], payload: Any) -> bool:
        """Whether a central job of this name, target and payload is this host's."""
        if target.get("type") != "queue" or not isinstance(payload, Mapping):
            return False
        queue = target.get("name")
        if not isinstance(queue, str) or not self.allows_queue(queue):
            return False
        if not placement.is_apply_payload(dict(payload)) or not isinstance(payload.get("job"), str):
            return False
        if queue.startswith(placement.GROUP_QUEUE_PREFIX):
            # one central job per group, applied by any of its hosts
            return bool(name == payload["job"])
        return bool(payload.get("host") == self.host and name == f"{payload['job']}@{self.host}")

    def owns_job(self, job: Job) -> bool:
        """`owns` of a central job."""
        return self.owns(job.name, job.target.to_dict(), job.payload)

    def check_body(self, body: Any, current: Job | None = None) -> None:
        """A create body (`current` None) or an update body of the central job `current`
        that a host token may send: only the keys apply sends, and the job it makes is
        this host's, applied by this host. Forbidden otherwise; nothing is written."""
        if not isinstance(body, Mapping):
            return  # the service refuses it, naming the body
        extra = sorted(str(k) for k in body if k not in HOST_BODY_KEYS)
        if extra:
            raise errors.Forbidden(
                f"a host token may not set {', '.join(extra)}: only what `schedctl apply` sends",
                field=extra[0],
            )
        if current is None:
            name, target, payload = body.get("name"), body.get("target"), body.get("payload")
        else:
            name = body.get("name", current.name)
            target = body.get("target", current.target.to_dict())
            payload = body.get("payload", current.payload)
        if not isinstance(target, Mapping) or not isinstance(name, str):
            raise errors.Forbidden(
                "a host token's job needs a name and a queue target of its host", field="target"
            )
        applied_here = isinstance(payload, Mapping) and payload.get("host") == self.host
        if not (applied_here and self.owns(name, target, payload)):
            raise errors.Forbidden(
                f"a host token (host {self.host}) may only define the jobs its own files "
                f"define: NAME@{self.host} on host:{self.host} or every:{self.host}, or a "
                "job of one of its groups, with apply's payload {job_file, job, host, digest} "
                "naming this host",
                field="target" if not self.allows_queue(str(target.get("name"))) else "payload",
            )

    def check_after(self, refs: Iterable[Any], lookup: Callable[[str], list[Job]]) -> None:
        """Each upstream job of a host token's `after` (an id or a name; `lookup` gives the
        tenant's jobs it may mean) is one of this host's own: Forbidden naming `after`
        otherwise, as for a job that does not exist (another host's stays unseen)."""
        for ref in refs:
            if not isinstance(ref, str):
                continue  # the service refuses it, naming `after`
            found = lookup(ref)
            if not found or not all(self.owns_job(job) for job in found):
                raise errors.Forbidden(
                    f"a host token's job runs only after jobs of its own host "
                    f"({self.host}): {ref!r} is not one",
                    field="after",
                )
