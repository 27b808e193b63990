"""Owns `ApiClient`, the Python client of the tenant REST API (`scheduled-d api`).

It has the job and run methods of `schedctl.app.service.Scheduler` with the same names, arguments
and return types, and raises the same SchedError subclasses (rebuilt from the JSON error
bodies' codes by schedctl.core.errors.from_code, the one table of codes), so
`schedctl --api URL` runs the job commands against a remote API unchanged.

Differences that follow from HTTP: the token decides the tenant (a `tenant` argument must
name the token's own tenant), the audit log records the token id rather than `actor`, and
an unreachable API is StoreUnavailable (exit code 7), like an unreachable database.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import quote

import requests

from schedctl import __version__
from schedctl.app.views import job_from_dict, run_from_dict
from schedctl.clients.api_call import api_base_url, authorize, send
from schedctl.core import errors
from schedctl.core.closing import Closing
from schedctl.domain.alerts.model import AlertConfig, parse_alerts
from schedctl.domain.job_refs import shortest_among
from schedctl.domain.models import CreateOutcome, Job, JobStatus, Page, Run

DEFAULT_TIMEOUT_SECONDS = 30.0


class ApiClient(Closing):
    def __init__(
        self,
        base_url: str,
        token: str,
        *,
        timeout: float = DEFAULT_TIMEOUT_SECONDS,
        session: requests.Session | None = None,
    ) -> None:
        self.base_url = api_base_url(base_url, errors.ValidationError)
        if not token:
            raise errors.Unauthorized(
                "an API token is needed: --token or SCHEDULED_API_TOKEN", field="token"
            )
        self.timeout = timeout
        self.session = authorize(session or requests.Session(), token, f"schedctl/{__version__}")
        self._tenant: dict[str, Any] | None = None

    def close(self) -> None:
        self.session.close()

    # -- the caller --------------------------------------------------------------------

    def whoami(self) -> dict[str, Any]:
        """The token's tenant (GET /v1/tenant): id, name, quotas and the token id."""
        if self._tenant is None:
            self._tenant = self._json("GET", "/v1/tenant")
        return self._tenant

    def _check_tenant(self, tenant: str | None) -> None:
        if tenant is None:
            return
        mine = self.whoami()
        if tenant not in (mine.get("name"), mine.get("tenant_id")):
            raise errors.ValidationError(
                f"the API token belongs to tenant {mine.get('name')!r}, not {tenant!r}: "
                "with --api the token decides the tenant",
                field="tenant",
            )

    # -- jobs (the Scheduler's names and types) ----------------------------------------

    def create_job(
        self, tenant: str | None, body: Mapping[str, Any], *, actor: str = ""
    ) -> tuple[Job, bool]:
        """(job, created); the body's idempotency_key travels as the Idempotency-Key header."""
        del actor  # the server records the token id
        self._check_tenant(tenant)
        headers = {}
        data = dict(body)
        key = data.pop("idempotency_key", None)
        if isinstance(key, str):
            headers["Idempotency-Key"] = key
        elif key is not None:
            data["idempotency_key"] = key  # not a string: let the server refuse it
        response = self._request("POST", "/v1/jobs", json=data, headers=headers)
        return job_from_dict(_body(response)), response.status_code == 201

    def create_many(
        self, tenant: str | None, bodies: Sequence[Any], *, actor: str = ""
    ) -> list[CreateOutcome]:
        """POST /v1/jobs:batch (up to MAX_BATCH_JOBS bodies, each with its own
        idempotency_key): one CreateOutcome per body, in order, each refusal rebuilt as the
        SchedError its code names."""
        del actor  # the server records the token id
        self._check_tenant(tenant)
        return self._batch(len(bodies), json={"jobs": list(bodies)})

    def import_many(self, tenant: str | None, encoded: Sequence[str]) -> list[CreateOutcome]:
        """create_many of bodies already encoded as JSON text (a JSON Lines file's lines),
        answered with Prefer: return=minimal: each CreateOutcome says created or replayed, with
        no job (its id and name are all the server sends), or holds the error."""
        self._check_tenant(tenant)
        return self._batch(
            len(encoded),
            data=('{"jobs":[' + ",".join(encoded) + "]}").encode(),
            headers={"Content-Type": "application/json", "Prefer": "return=minimal"},
        )

    def _batch(self, count: int, **request: Any) -> list[CreateOutcome]:
        """POST /v1/jobs:batch (`request`: the body and headers) -> `count` outcomes."""
        data = self._json("POST", "/v1/jobs:batch", **request)
        results = data.get("results")
        if not isinstance(results, list) or len(results) != count:
            raise errors.SchedError("the API answered the batch with unexpected JSON")
        return [_outcome(item) for item in results]

    def get_job(self, job_id: str, tenant: str | None = None) -> Job:
        self._check_tenant(tenant)
        return job_from_dict(self._json("GET", self._job_path(job_id)))

    def job_dependencies(self, job_id: str, tenant: str | None = None) -> dict[str, Any]:
        """The job's upstream and downstream jobs (`after`), as trees."""
        self._check_tenant(tenant)
        data: dict[str, Any] = self._json("GET", self._job_path(job_id, "dependencies"))
        return data

    def job_why(self, job_id: str, tenant: str | None = None) -> dict[str, Any]:
        """`schedctl job why` over the API (GET /v1/jobs/{id}/why)."""
        self._check_tenant(tenant)
        data: dict[str, Any] = self._json("GET", self._job_path(job_id, "why"))
        return data

    def list_jobs(
        self,
        tenant: str | None = None,
        status: str | JobStatus | None = None,
        limit: int = 50,
        cursor: str | None = None,
    ) -> Page:
        self._check_tenant(tenant)
        params: dict[str, Any] = {"limit": limit}
        if status is not None:
            params["status"] = status.value if isinstance(status, JobStatus) else status
        if cursor:
            params["cursor"] = cursor
        data = self._json("GET", "/v1/jobs", params=params)
        return Page(tuple(job_from_dict(j) for j in data["items"]), data.get("next_cursor"))

    def cancel_job(self, job_id: str, tenant: str | None = None, *, actor: str = "") -> Job:
        del actor
        self._check_tenant(tenant)
        return job_from_dict(self._json("POST", self._job_path(job_id, "cancel")))

    def pause_job(self, job_id: str, tenant: str | None = None, *, actor: str = "") -> Job:
        del actor
        self._check_tenant(tenant)
        return job_from_dict(self._json("POST", self._job_path(job_id, "pause")))

    def resume_job(self, job_id: str, tenant: str | None = None, *, actor: str = "") -> Job:
        del actor
        self._check_tenant(tenant)
        return job_from_dict(self._json("POST", self._job_path(job_id, "resume")))

    def trigger_job(self, job_id: str, tenant: str | None = None, *, actor: str = "") -> Run:
        del actor
        self._check_tenant(tenant)
        return run_from_dict(self._json("POST", self._job_path(job_id, "trigger")))

    def reschedule_job(
        self,
        job_id: str,
        schedule_body: Mapping[str, Any],
        tenant: str | None = None,
        *,
        actor: str = "",
    ) -> Job:
        del actor
        self._check_tenant(tenant)
        data = self._json("PATCH", self._job_path(job_id), json={"schedule": dict(schedule_body)})
        return job_from_dict(data)

    def runs(
        self,
        job_id: str,
        tenant: str | None = None,
        limit: int = 50,
        cursor: str | None = None,
    ) -> Page:
        """Run history, newest first."""
        self._check_tenant(tenant)
        params: dict[str, Any] = {"limit": limit}
        if cursor:
            params["cursor"] = cursor
        data = self._json("GET", self._job_path(job_id, "runs"), params=params)
        return Page(tuple(run_from_dict(r) for r in data["items"]), data.get("next_cursor"))

    def get_alerts(self, tenant: str | None, job_id: str | None = None) -> AlertConfig | None:
        """A job's own alerts (GET /v1/jobs/{id}/alerts); None: it uses the default."""
        data = self._json("GET", self._job_path(_alerts_job(job_id), "alerts"))
        return parse_alerts(data["alerts"]) if data.get("alerts") is not None else None

    def set_alerts(
        self, tenant: str | None, body: Mapping[str, Any] | None, job_id: str | None = None
    ) -> AlertConfig | None:
        """Replace (None: clear) a job's own alerts (PUT /v1/jobs/{id}/alerts)."""
        path = self._job_path(_alerts_job(job_id), "alerts")
        if body is None:  # a JSON null clears them (json=None would send no body at all)
            data = self._json(
                "PUT", path, data="null", headers={"Content-Type": "application/json"}
            )
        else:
            data = self._json("PUT", path, json=dict(body))
        return parse_alerts(data["alerts"]) if data.get("alerts") is not None else None

    def get_job_by_name(self, name: str, tenant: str | None = None) -> Job:
        self._check_tenant(tenant)
        return job_from_dict(self._json("GET", f"/v1/jobs/by-name/{quote(name, safe='/')}"))

    def resolve_job(self, tenant: str | None, ref: str) -> str:
        """The id of the job `ref` names (id, name or id prefix), resolved by the server."""
        return self.get_job(ref, tenant).job_id

    def _job_path(self, ref: str, action: str | None = None) -> str:
        # the id routes take any job reference, but a path segment cannot hold a slash:
        # a name with one is looked up by the by-name route first
        if "/" in ref:
            ref = self.get_job_by_name(ref).job_id
        path = f"/v1/jobs/{quote(ref, safe='')}"
        return f"{path}/{action}" if action else path

    def short_job_ids(self, tenant: str | None, job_ids: list[str]) -> dict[str, str]:
        """Shortest unique prefixes (at least 8 characters) among `job_ids` only: the API
        does not list other jobs' ids, so with --api a table's prefix is unique among the
        rows shown (a command given a prefix the server finds ambiguous says so)."""
        self._check_tenant(tenant)
        return shortest_among(job_ids)

    def update_job(
        self,
        job_id: str,
        body: Mapping[str, Any],
        tenant: str | None = None,
        *,
        if_version: int | None = None,
        actor: str = "",
    ) -> Job:
        del actor
        self._check_tenant(tenant)
        headers = {} if if_version is None else {"If-Match": str(if_version)}
        return job_from_dict(
            self._json("PATCH", self._job_path(job_id), json=dict(body), headers=headers)
        )

    def delete_job(
        self,
        job_id: str,
        tenant: str | None = None,
        *,
        if_version: int | None = None,
        actor: str = "",
    ) -> None:
        """DELETE answers 204 without a body, and the job is gone: nothing to return."""
        del actor
        self._check_tenant(tenant)
        headers = {} if if_version is None else {"If-Match": str(if_version)}
        self._request("DELETE", self._job_path(job_id), headers=headers)

    # -- HTTP --------------------------------------------------------------------------

    def _json(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        return _body(self._request(method, path, **kwargs))

    def _request(self, method: str, path: str, **kwargs: Any) -> requests.Response:
        response = send(self.session, method, self.base_url, path, timeout=self.timeout, **kwargs)
        if response.status_code >= 400:
            raise _error(response)
        return response


def _outcome(item: Any) -> CreateOutcome:
    """One result of a batch: the job (201 created, 200 replayed) or its error."""
    if not isinstance(item, dict):
        raise errors.SchedError("the API answered the batch with unexpected JSON")
    if isinstance(item.get("job"), dict):
        return CreateOutcome(job=job_from_dict(item["job"]), created=item.get("status") == 201)
    if item.get("status") in (200, 201) and isinstance(item.get("job_id"), str):
        return CreateOutcome(created=item["status"] == 201)  # Prefer: return=minimal
    error, code = item.get("error"), item.get("status")
    detail: dict[str, Any] = error if isinstance(error, dict) else {}
    status = code if isinstance(code, int) else 500
    kind = errors.from_code(str(detail.get("code"))) or errors.from_status(status)
    kind = kind or errors.SchedError
    message = str(detail.get("message") or f"refused ({status})")
    field = detail.get("field") if isinstance(detail.get("field"), str) else None
    if issubclass(kind, errors.QuotaExceeded):
        retry = item.get("retry_after")
        return CreateOutcome(
            error=kind(message, field=field, retry_after=retry if isinstance(retry, int) else None)
        )
    return CreateOutcome(error=kind(message, field=field))


def _alerts_job(job_id: str | None) -> str:
    if job_id is None:
        raise errors.ValidationError(
            "a tenant's default alerts are set on the database (drop --api)", field="--api"
        )
    return job_id


def _body(response: requests.Response) -> dict[str, Any]:
    try:
        data = response.json()
    except ValueError as exc:
        raise errors.SchedError(
            f"the API answered {response.status_code} without a JSON body ({response.url})"
        ) from exc
    if not isinstance(data, dict):
        raise errors.SchedError(f"the API answered with unexpected JSON ({response.url})")
    return data


def _error(response: requests.Response) -> errors.SchedError:
    """The SchedError a JSON error body describes: the class of its code (schedctl.core.errors),
    else of the answer's status."""
    by_status = errors.from_status(response.status_code) or errors.SchedError
    try:
        detail = response.json()["error"]
        code, message = str(detail["code"]), str(detail["message"])
        field = detail.get("field")
    except (ValueError, KeyError, TypeError):
        return by_status(
            f"the API answered {response.status_code} {response.reason} ({response.url})"
        )
    kind = errors.from_code(code) or by_status
    field = field if isinstance(field, str) else None
    if issubclass(kind, errors.QuotaExceeded):
        retry = response.headers.get("Retry-After", "")
        seconds = int(retry) if retry.isascii() and retry.isdigit() and len(retry) <= 6 else None
        return kind(message, field=field, retry_after=seconds)
    return kind(message, field=field)
