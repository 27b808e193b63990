"""Owns the proof that the API's documented create request (scheduled_d.api.schemas) and its
parser (schedctl.domain.jobspec, the CLI's) describe the same request, field by field: the same
names at every level, the same types, and the bounds of schedctl.core.limits and jobspec."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from schedctl.core import errors, limits
from schedctl.domain import jobspec
from schedctl.scheduling.misfire import MisfirePolicy
from scheduled_d.api.schemas import (
    JOB_REQUEST_EXAMPLES,
    JOB_REQUEST_SCHEMA,
    RESCHEDULE_SCHEMA,
)

NOW = datetime(2026, 1, 1, tzinfo=UTC)
PROPS: dict[str, Any] = JOB_REQUEST_SCHEMA["properties"]
BASE: dict[str, Any] = {"schedule": {"delay": 60}, "target": {"type": "queue", "name": "q"}}


def parse(**fields: Any) -> None:
    jobspec.parse_job_request({**BASE, **fields}, now=NOW)


def refused(field: str, **fields: Any) -> None:
    with pytest.raises(errors.ValidationError) as caught:
        parse(**fields)
    assert caught.value.field is not None and caught.value.field.startswith(field)


def test_the_same_top_level_names_and_required_ones() -> None:
    assert set(PROPS) == jobspec.TOP_LEVEL_KEYS
    assert JOB_REQUEST_SCHEMA["additionalProperties"] is False
    for name in JOB_REQUEST_SCHEMA["required"]:
        body = {k: v for k, v in BASE.items() if k != name}
        with pytest.raises(errors.ValidationError):
            jobspec.parse_job_request(body, now=NOW)
    refused("surprise", surprise=1)


def test_the_same_schedule_kinds_and_names() -> None:
    variants = JOB_REQUEST_SCHEMA["properties"]["schedule"]["oneOf"]
    assert RESCHEDULE_SCHEMA["properties"]["schedule"]["oneOf"] == variants
    assert [v["required"][0] for v in variants] == list(jobspec.SCHEDULE_KINDS)
    assert set().union(*(v["properties"] for v in variants)) == jobspec.SCHEDULE_KEYS
    assert all(v["additionalProperties"] is False for v in variants)
    assert [set(v["properties"]) for v in variants] == [
        {"run_at"},
        {"delay"},
        {"cron", "timezone"},
        {"every", "anchor"},
        {"boot"},
    ]
    refused("schedule", schedule={"delay": 60, "cron": "* * * * *"})


def test_the_same_target_kinds_and_names() -> None:
    queue, http = JOB_REQUEST_SCHEMA["properties"]["target"]["oneOf"]
    assert set(queue["properties"]) == {"type", "name"}
    assert set(http["properties"]) == {"type", "url"}
    assert queue["properties"]["name"]["pattern"] == f"^{jobspec.QUEUE_NAME.pattern}$"
    assert http["properties"]["url"]["maxLength"] == jobspec.MAX_URL_LENGTH
    parse(target={"type": "queue", "name": "a" * 200})
    refused("target.name", target={"type": "queue", "name": "a" * 201})
    refused("target.", target={"type": "queue", "name": "q", "url": "https://x.example"})
    refused("target.", target={"type": "http", "url": "https://x.example", "name": "q"})


def test_the_same_retry_names_and_bounds() -> None:
    retry = PROPS["retry"]
    assert set(retry["properties"]) == jobspec.RETRY_KEYS
    attempts = retry["properties"]["max_attempts"]
    assert (attempts["type"], attempts["minimum"], attempts["maximum"]) == (
        "integer",
        1,
        limits.MAX_ATTEMPTS,
    )
    parse(retry={"max_attempts": limits.MAX_ATTEMPTS})
    refused("retry.max_attempts", retry={"max_attempts": limits.MAX_ATTEMPTS + 1})
    refused("retry.max_attempts", retry={"max_attempts": 0})
    assert retry["properties"]["backoff"] == {"const": "exponential"}


def test_the_same_text_bounds() -> None:
    assert PROPS["name"] == {
        "type": "string",
        "minLength": 1,
        "maxLength": jobspec.MAX_NAME_LENGTH,
    }
    parse(name="n" * jobspec.MAX_NAME_LENGTH)
    refused("name", name="n" * (jobspec.MAX_NAME_LENGTH + 1))
    key = PROPS["idempotency_key"]
    assert (key["type"], key["minLength"], key["maxLength"]) == (
        "string",
        1,
        jobspec.MAX_IDEMPOTENCY_KEY_LENGTH,
    )
    parse(idempotency_key="k" * jobspec.MAX_IDEMPOTENCY_KEY_LENGTH)
    refused("idempotency_key", idempotency_key="k" * (jobspec.MAX_IDEMPOTENCY_KEY_LENGTH + 1))


def test_the_same_enum_and_concurrency_bounds() -> None:
    assert PROPS["misfire_policy"] == {"enum": [p.value for p in MisfirePolicy]}
    refused("misfire_policy", misfire_policy="sometimes")
    integer, null = PROPS["max_concurrency"]["anyOf"]
    assert integer == {"type": "integer", "minimum": 1, "maximum": limits.MAX_CONCURRENCY}
    assert null == {"type": "null"}
    parse(max_concurrency=None)
    parse(max_concurrency=limits.MAX_CONCURRENCY)
    refused("max_concurrency", max_concurrency=limits.MAX_CONCURRENCY + 1)
    refused("max_concurrency", max_concurrency=0)


@pytest.mark.parametrize("field", ["grace", "window", "timeout"])
def test_the_same_duration_bounds(field: str) -> None:
    number = next(s for s in PROPS[field]["anyOf"] if s["type"] == "number")
    assert (number["minimum"], number["maximum"]) == (0, limits.MAX_DURATION_SECONDS)
    assert PROPS["retry"]["properties"]["base_delay"] == PROPS[field]
    parse(**{field: limits.MAX_DURATION_SECONDS})
    refused(field, **{field: limits.MAX_DURATION_SECONDS + 1})
    refused(field, **{field: "soon"})


@pytest.mark.parametrize("field", ["start", "end"])
def test_the_same_instants(field: str) -> None:
    assert PROPS[field]["type"] == "string" and PROPS[field]["format"] == "date-time"
    refused(field, **{field: "tomorrow"})


@pytest.mark.parametrize("name", sorted(JOB_REQUEST_EXAMPLES))
def test_the_documented_examples_parse(name: str) -> None:
    jobspec.parse_job_request(JOB_REQUEST_EXAMPLES[name]["value"], now=NOW)
