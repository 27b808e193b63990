"""Owns `ApiLeaseBackend`, the tenant worker's LeaseBackend over the REST API
(`scheduled-d worker --api URL`): leases, heartbeats, acks and fails runs of the token's
tenant's queue through POST /v1/queues/{name}/leases and /v1/leases/{id}/heartbeat|ack|fail.

It needs only the API's URL and the tenant's token: no database credentials, and nothing of
the database layer is imported. An unreachable API, a timeout or a 5xx is StoreUnavailable
(the worker retries, as it does when its database is away); a 404 on a lease means the lease
is no longer held (lost); a 401 is Unauthorized (a wrong or revoked token stops the worker).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar
from urllib.parse import quote

import requests

from schedctl import __version__
from schedctl.clients.api_call import api_base_url, authorize, send
from schedctl.clients.client import ApiClient
from schedctl.core import errors, limits
from schedctl.domain.leasing import Beat, Finish, LeaseBackend, LeasedRun, Settlement
from schedctl.scheduling.timeparse import format_instant

R = TypeVar("R")

DEFAULT_TIMEOUT_SECONDS = 10.0
# what the run history keeps of an output tail and an error (longer ones are refused)
MAX_OUTPUT_TAIL_CHARS = limits.MAX_OUTPUT_BYTES
MAX_ERROR_CHARS = 4096
# The API refuses request bodies over its limit (at least 1 MiB, scheduled_d.api); an output
# tail is cut to fit this many bytes of JSON text, leaving room for the rest of the body
# (an error of MAX_ERROR_CHARS, even escaped, and the times).
MAX_OUTPUT_JSON_BYTES = 1024 * 1024 - 64 * 1024


@dataclass(frozen=True)
class ApiLease:
    """A run leased through the API; `lease_id` is what settles it."""

    lease_id: str
    queue: str
    job_id: str
    scheduled_at: datetime
    idempotency_key: str
    attempt: int
    max_attempts: int
    timeout_seconds: int
    payload: Any
    leased_until: datetime

    def __repr__(self) -> str:
        # never the payload nor the lease id (it is what acts on the run)
        return (
            f"ApiLease(queue={self.queue!r}, job_id={self.job_id!r}, "
            f"scheduled_at={format_instant(self.scheduled_at)}, attempt={self.attempt})"
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ApiLease:
        return cls(
            lease_id=str(data["lease_id"]),
            queue=str(data["queue"]),
            job_id=str(data["job_id"]),
            scheduled_at=_instant(data["scheduled_at"]),
            idempotency_key=str(data["idempotency_key"]),
            attempt=int(data["attempt"]),
            max_attempts=int(data["max_attempts"]),
            timeout_seconds=int(data["timeout_seconds"]),
            payload=data.get("payload"),
            leased_until=_instant(data["leased_until"]),
        )


@dataclass(frozen=True)
class ApiAlert:
    """A command alert leased through the API; `lease_id` is what finishes it."""

    lease_id: str
    job_id: str
    kind: str
    attempt: int
    body: Any

    def __repr__(self) -> str:
        return f"ApiAlert(job_id={self.job_id!r}, kind={self.kind!r}, attempt={self.attempt})"


class ApiLeaseBackend(LeaseBackend):
    """LeaseBackend over the tenant REST API at `base_url`, authenticated by `token`.

    - timeout: seconds per HTTP call; keep it under the heartbeat interval's slack, since a
      heartbeat waits for its answer.
    """

    def __init__(
        self,
        base_url: str,
        token: str,
        *,
        timeout: float = DEFAULT_TIMEOUT_SECONDS,
        session: requests.Session | None = None,
        connections: int = 10,
    ) -> None:
        self.base_url = api_base_url(base_url, errors.ConfigError)
        if not token:
            raise errors.ConfigError(
                "the worker needs the tenant's API token: SCHEDULED_API_TOKEN or --token-file",
                field="token",
            )
        self.timeout = timeout
        if session is None:
            session = requests.Session()
            # one kept-alive connection per command that may heartbeat or settle at once, plus
            # the lease loop's: a smaller pool drops connections and warns at every run
            adapter = requests.adapters.HTTPAdapter(pool_maxsize=max(connections, 1) + 1)
            session.mount("http://", adapter)
            session.mount("https://", adapter)
        self.session = authorize(session, token, f"scheduled-d/{__version__}")
        self._token = token  # for jobs_client(): the host's own central jobs
        # the outcomes (and heartbeats) due together go out side by side, one call each:
        # the API takes one lease per call
        self._calls = ThreadPoolExecutor(max(connections, 1), thread_name_prefix="api-lease")

    def close(self) -> None:
        self._calls.shutdown(wait=True)
        self.session.close()

    # -- LeaseBackend ------------------------------------------------------------------

    def lease(self, queue: str, owner: str, lease_seconds: float, limit: int) -> list[ApiLease]:
        """`owner` is the worker's name for its logs; the API makes its own, unforgeable one."""
        del owner
        data = self._post(
            f"/v1/queues/{quote(queue, safe='/')}/leases",
            {"limit": limit, "lease_seconds": lease_seconds},
        )
        assert data is not None  # only lease routes answer 404
        return [ApiLease.from_dict(item) for item in data["items"]]

    def beat(self, lease: LeasedRun, lease_seconds: float, output_tail: str | None = None) -> Beat:
        body: dict[str, Any] = {"lease_seconds": lease_seconds}
        if output_tail is not None:
            body["output_tail"] = fit_output(output_tail)
        data = self._post(_lease_path(lease, "heartbeat"), body)
        return Beat.lost if data is None else Beat(data["status"])

    def settle(self, lease: LeasedRun, settlement: Settlement) -> bool:
        """POST .../ack, or .../fail where `cancelled` tells the API not to retry."""
        body: dict[str, Any] = {
            "exit_code": settlement.exit_code,
            "output_tail": fit_output(settlement.output_tail),
            "started_at": format_instant(settlement.started_at),
            "finished_at": format_instant(settlement.finished_at),
        }
        action = "ack"
        if settlement.finish is not Finish.succeeded:
            action = "fail"
            body["error"] = (settlement.error or "")[:MAX_ERROR_CHARS]
            body["cancelled"] = settlement.finish is Finish.cancelled
        return self._post(_lease_path(lease, action), body) is not None

    def settle_many(
        self, items: Sequence[tuple[LeasedRun, Settlement]]
    ) -> list[bool | errors.StoreUnavailable]:
        return self._side_by_side([functools.partial(self.settle, *item) for item in items])

    def beat_many(
        self, items: Sequence[tuple[LeasedRun, str | None]], lease_seconds: float
    ) -> list[Beat | errors.StoreUnavailable]:
        return self._side_by_side(
            [functools.partial(self.beat, lease, lease_seconds, tail) for lease, tail in items]
        )

    def _side_by_side(self, calls: list[Callable[[], R]]) -> list[R | errors.StoreUnavailable]:
        """Each call's result, or the StoreUnavailable it raised; at once over the pool."""

        def one(call: Callable[[], R]) -> R | errors.StoreUnavailable:
            try:
                return call()
            except errors.StoreUnavailable as exc:
                return exc

        if len(calls) == 1:
            return [one(calls[0])]
        return list(self._calls.map(one, calls))

    # -- command alerts and the jobs they are about (the host worker) -------------------

    def lease_alerts(self, queue: str, limit: int = 10) -> list[ApiAlert]:
        """Due command alerts of the jobs of `queue` (POST .../alert-leases)."""
        data = self._post(f"/v1/queues/{quote(queue, safe='/')}/alert-leases", {"limit": limit})
        assert data is not None
        return [
            ApiAlert(
                lease_id=str(item["lease_id"]),
                job_id=str(item["job_id"]),
                kind=str(item["kind"]),
                attempt=int(item["attempt"]),
                body=item.get("body"),
            )
            for item in data["items"]
        ]

    def finish_alert(self, alert: ApiAlert, error: str | None) -> bool:
        """Record the alert command's outcome; False when the lease was no longer held."""
        body = {"error": error[-MAX_ERROR_CHARS:] if error is not None else None}
        path = f"/v1/alert-leases/{quote(alert.lease_id, safe='')}/finish"
        return self._post(path, body) is not None

    def job_payload(self, job_id: str) -> Any:
        """The central job's payload (GET /v1/jobs/{id}); NotFound when the token cannot
        see the job."""
        response = send(
            self.session,
            "GET",
            self.base_url,
            f"/v1/jobs/{quote(job_id, safe='')}",
            timeout=self.timeout,
        )
        if response.status_code >= 400:
            raise _error(response)
        try:
            return response.json()["payload"]
        except (ValueError, KeyError, TypeError) as exc:
            raise errors.StoreUnavailable("the API answered with unexpected JSON") from exc

    def record_boot_run(
        self,
        name: str,
        *,
        seconds: float,
        exit_code: int | None,
        error: str | None,
        output: str | None,
    ) -> dict[str, Any] | None:
        """POST /v1/boot-runs: the ended run of this host's @reboot job `name` (its central
        name); NotFound when the token sees no such job."""
        body = {
            "job": name,
            "seconds": round(max(0.0, seconds), 3),
            "exit_code": exit_code,
            "error": error[-MAX_ERROR_CHARS:] if error is not None else None,
            "output": fit_output(output),
        }
        return self._post("/v1/boot-runs", body)

    def jobs_client(self) -> ApiClient:
        """The API client of the same token (the host's own central jobs, for its drift)."""
        return ApiClient(self.base_url, self._token, timeout=self.timeout)

    def report_drift(self, drift: list[str]) -> None:
        """POST /v1/host-drift: this host's job-file drift ([] when in step)."""
        response = send(
            self.session, "POST", self.base_url, "/v1/host-drift", timeout=self.timeout,
            json={"drift": drift},
        )  # fmt: skip
        if response.status_code >= 400:
            raise _error(response)

    def whoami(self) -> dict[str, Any]:
        """GET /v1/tenant: the token's tenant and, for a host token, its host and groups."""
        response = send(self.session, "GET", self.base_url, "/v1/tenant", timeout=self.timeout)
        if response.status_code >= 400:
            raise _error(response)
        try:
            data = response.json()
        except ValueError as exc:
            raise errors.StoreUnavailable("the API answered without a JSON body") from exc
        if not isinstance(data, dict):
            raise errors.StoreUnavailable("the API answered with unexpected JSON")
        return data

    def reap(self) -> int:
        # expired leases are settled server-side (by the relay): nothing to do here
        return 0

    # -- HTTP --------------------------------------------------------------------------

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any] | None:
        """The JSON answer; None on a 404 of a lease route (the lease is not held)."""
        response = send(self.session, "POST", self.base_url, path, timeout=self.timeout, json=body)
        if response.status_code == 404 and path.startswith(("/v1/leases/", "/v1/alert-leases/")):
            return None
        if response.status_code >= 400:
            raise _error(response)
        try:
            data = response.json()
        except ValueError as exc:
            raise errors.StoreUnavailable(
                f"the API answered {response.status_code} without a JSON body"
            ) from exc
        if not isinstance(data, dict):
            raise errors.StoreUnavailable("the API answered with unexpected JSON")
        return data


def _lease_path(lease: LeasedRun, action: str) -> str:
    assert isinstance(lease, ApiLease), "a lease is settled by the backend that leased it"
    return f"/v1/leases/{quote(lease.lease_id, safe='')}/{action}"


def fit_output(text: str | None, budget: int = MAX_OUTPUT_JSON_BYTES) -> str | None:
    """The longest end of `text` (at most MAX_OUTPUT_TAIL_CHARS characters) whose JSON
    text (as requests sends it: ASCII, escapes of up to 12 bytes a character) is at most
    `budget` bytes: the request stays under the API's size limit whatever the output."""
    if text is None:
        return None
    # every character takes at least a byte, and the quotes two: a cut that costs nothing
    text = text[-min(MAX_OUTPUT_TAIL_CHARS, max(budget - 2, 0)) :] if budget > 2 else ""
    if len(json.dumps(text)) <= budget:
        return text
    # binary search on where the kept end starts: at most ~21 encodings of 1 MiB
    low, high = 0, len(text)  # text[high:] fits (the empty end does), text[low:] does not
    while high - low > 1:
        middle = (low + high) // 2
        if len(json.dumps(text[middle:])) <= budget:
            high = middle
        else:
            low = middle
    return text[high:]


def _instant(value: Any) -> datetime:
    return datetime.fromisoformat(str(value).replace("Z", "+00:00"))


def _error(response: requests.Response) -> errors.SchedError:
    """The SchedError of an error answer, by its status (schedctl.core.errors.from_status); what
    is worth retrying (a 5xx, a quota) is StoreUnavailable, which the worker waits out, and
    any other refusal but a token's or a lease's is invalid input."""
    try:
        detail = response.json()["error"]
        message = str(detail["message"])
    except (ValueError, KeyError, TypeError):
        message = f"{response.status_code} {response.reason}"
    text = f"the API answered {response.status_code}: {message}"
    kind = errors.from_status(response.status_code)
    if response.status_code >= 500 or kind is errors.QuotaExceeded:
        return errors.StoreUnavailable(text)
    if kind is errors.Unauthorized:
        return errors.Unauthorized(text, field="token")
    if kind is errors.Forbidden:  # a host token outside its host's queues: stop, say why
        return errors.Forbidden(text, field="token")
    if kind is errors.NotFound:
        return errors.NotFound(text)
    return errors.ValidationError(text)
