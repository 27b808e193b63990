"""Owns the path and query parameters the job and run routes share: the job reference (an id,
a name or an id prefix; one no name could be is 404 before any query), the page limit and
cursor, the status filter and the Idempotency-Key header."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Header, Path, Query
from pydantic import BeforeValidator

from schedctl.core import errors, limits
from schedctl.domain.jobspec import MAX_NAME_LENGTH
from schedctl.domain.models import JobStatus
from schedctl.storage.jobs.jobs import MAX_PAGE

JobIdPath = Annotated[
    str, Path(description="The job id, its name, or an unambiguous id prefix (6+ hex digits).")
]


def _ascii_integer(value: Any) -> Any:
    # pydantic's lax int takes "1.0" and " 1 "; a query integer is ASCII digits (limits)
    if isinstance(value, str) and not (value.isascii() and value.isdigit() and len(value) < 20):
        raise ValueError("must be an integer (ASCII digits)")
    return value


LimitQuery = Annotated[
    int,
    BeforeValidator(_ascii_integer),
    Query(ge=1, le=MAX_PAGE, description=f"Items per page (1-{MAX_PAGE})."),
]
CursorQuery = Annotated[
    str | None,
    Query(max_length=limits.MAX_CURSOR_LENGTH, description="The next_cursor of the previous page."),
]
StatusQuery = Annotated[JobStatus | None, Query(description="Only jobs in this status.")]
_IDEMPOTENCY_DESCRIPTION = (
    "Same key and same body: the same job again (200). Same key, other body: 409. "
    "Keys are kept as long as their job (at least 24 h)."
)
# the Idempotency-Key header as an OpenAPI parameter, for the route that reads it itself
# (POST /v1/jobs)
IDEMPOTENCY_PARAMETER: dict[str, Any] = {
    "name": "Idempotency-Key",
    "in": "header",
    "required": False,
    "description": _IDEMPOTENCY_DESCRIPTION,
    "schema": {
        "anyOf": [{"type": "string"}, {"type": "null"}],
        "description": _IDEMPOTENCY_DESCRIPTION,
        "title": "Idempotency-Key",
    },
}


def checked_job_id(job_id: str) -> str:
    # a job reference: an id, a name or an id prefix (schedctl.storage.jobs.job_lookup); one no
    # name could be (too long, control characters) cannot exist and must not reach the
    # database as is (Postgres refuses NUL characters in text with an error, not an empty
    # result)
    if len(job_id) > MAX_NAME_LENGTH or any(ord(c) < 32 or ord(c) == 127 for c in job_id):
        raise errors.NotFound(f"no job {job_id!r}", field="job_id")
    return job_id


PreferHeader = Annotated[
    str | None,
    Header(
        alias="Prefer",
        description=(
            "RFC 7240. `return=minimal`: each created or replayed job's result carries its "
            "job_id and name instead of the whole job (the answer says Preference-Applied)."
        ),
    ),
]


def prefers_minimal(prefer: str | None) -> bool:
    """Whether a Prefer header (RFC 7240: preferences separated by commas, each
    `token[=value]` with `;` parameters after it) asks for `return=minimal`."""
    if not prefer:
        return False
    for preference in prefer.split(","):
        token, _, value = preference.partition(";")[0].partition("=")
        if token.strip().lower() == "return" and value.strip().strip('"').lower() == "minimal":
            return True
    return False


IfMatchHeader = Annotated[
    str | None,
    Header(
        alias="If-Match",
        description="The job's version as read (its ETag, or the bare number), or * for "
        "any version: another version is 409.",
    ),
]
