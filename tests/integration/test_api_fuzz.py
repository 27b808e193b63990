"""Owns the fuzzing of the tenant REST API with schemathesis against its own /openapi.json:
for every operation, schema-valid and schema-violating requests (bounded, derandomized) sent
with a valid token to a real server on a real database. No response may be a 5xx, and every
response must match the document: declared status code, content type, headers and body.

Only conformance checks run: "schema-valid input is accepted" cannot hold for a scheduler
(a valid-looking cron expression or a past run_at is still refused), and that refusal is
checked for its shape like any other response.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi import checks as openapi_checks

from schedctl.app.service import Scheduler
from schedctl.storage.pipeline.queue import QueueRepo
from scheduled_d.api.server import ApiServer

MAX_EXAMPLES = 100  # per operation, per generation mode
CHECKS = [
    not_a_server_error,
    openapi_checks.status_code_conformance,
    openapi_checks.content_type_conformance,
    openapi_checks.response_headers_conformance,
    openapi_checks.response_schema_conformance,
]
OPERATIONS = [
    "POST /v1/jobs",
    "POST /v1/jobs:batch",
    "GET /v1/jobs",
    "GET /v1/jobs/{job_id}",
    "PATCH /v1/jobs/{job_id}",
    "DELETE /v1/jobs/{job_id}",
    "POST /v1/jobs/{job_id}/cancel",
    "POST /v1/jobs/{job_id}/pause",
    "POST /v1/jobs/{job_id}/resume",
    "POST /v1/jobs/{job_id}/trigger",
    "GET /v1/jobs/{job_id}/runs",
    "GET /v1/jobs/by-name/{name}",
    "GET /v1/jobs/{job_id}/dependencies",
    "GET /v1/jobs/{job_id}/why",
    "GET /v1/tenant",
    "GET /healthz",
    "POST /v1/queues/{name}/leases",
    "POST /v1/leases/{lease_id}/heartbeat",
    "POST /v1/leases/{lease_id}/ack",
    "POST /v1/leases/{lease_id}/fail",
    "POST /v1/queues/{name}/alert-leases",
    "POST /v1/alert-leases/{lease_id}/finish",
    "GET /v1/jobs/{job_id}/alerts",
    "PUT /v1/jobs/{job_id}/alerts",
    "POST /v1/boot-runs",
    "POST /v1/host-drift",
]


class Target:
    """A server on a fresh database with one tenant, its token and one job to aim at."""

    def __init__(self, sched: Scheduler, server: ApiServer, token: str, job_id: str) -> None:
        self.sched, self.server, self.token, self.job_id = sched, server, token, job_id
        self.document: dict[str, Any] = requests.get(
            server.url + "/openapi.json", timeout=10
        ).json()

    def lease_id(self) -> str:
        """A lease of a fresh run of the known job, for the lease routes to aim at."""
        self.sched.trigger_job(self.job_id, actor="test")
        QueueRepo(self.sched.store).move_outbox()
        response = requests.post(
            f"{self.server.url}/v1/queues/q/leases",
            json={"limit": 1},
            headers={"Authorization": f"Bearer {self.token}"},
            timeout=10,
        )
        (lease,) = response.json()["items"]
        return str(lease["lease_id"])


@pytest.fixture
def target(db_url: str) -> Iterator[Target]:
    sched = Scheduler.open(db_url)
    tenant, token = sched.create_tenant("fuzz", "test")
    # fuzzing creates many jobs in a burst: quotas would answer most of them 429
    sched.set_quotas("fuzz", max_jobs=1_000_000, create_rate_per_minute=1_000_000, actor="test")
    job, _ = sched.create_job(
        tenant,
        {"schedule": {"every": "1h"}, "target": {"type": "queue", "name": "q"}},
        actor="test",
    )
    server = ApiServer(sched, "127.0.0.1:0", access_log=False)
    server.start()
    try:
        yield Target(sched, server, token, job.job_id)
    finally:
        server.stop()
        sched.close()


def test_every_operation_is_fuzzed(target: Target) -> None:
    labels = sorted(
        f"{method.upper()} {path}"
        for path, item in target.document["paths"].items()
        for method in item
    )
    assert labels == sorted(OPERATIONS)
    schema = schemathesis.openapi.from_dict(target.document)
    assert all(schema.find_operation_by_label(label) is not None for label in OPERATIONS)


@pytest.mark.slow
@pytest.mark.parametrize("label", OPERATIONS)
def test_fuzz_operation(target: Target, label: str) -> None:
    method, path = label.split(" ", 1)
    schema = schemathesis.openapi.from_dict(target.document)
    operation = schema[path][method]
    if path.endswith("/resume"):
        # aimed at the known job, resume has something to do only when it is paused
        target.sched.pause_job(target.job_id, actor="test")
    headers = {"Authorization": f"Bearer {target.token}"}
    statuses: Counter[int] = Counter()

    # random lease ids are all 404: aim half the cases at a lease held (heartbeat, ack and
    # fail with any body; the first ack or fail that passes validation settles it)
    lease_id = target.lease_id() if "{lease_id}" in path else None
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
        strategy = operation.as_strategy(generation_mode=mode)
        if "{job_id}" in path:
            # random ids only ever find nothing: aim half the cases at a real job
            strategy = st.one_of(
                strategy,
                operation.as_strategy(
                    generation_mode=mode, path_parameters={"job_id": target.job_id}
                ),
            )
        if lease_id is not None:
            strategy = st.one_of(
                strategy,
                operation.as_strategy(generation_mode=mode, path_parameters={"lease_id": lease_id}),
            )
        if "{name}" in path:
            # and the queue the known job targets
            strategy = st.one_of(
                strategy,
                operation.as_strategy(generation_mode=mode, path_parameters={"name": "q"}),
            )

        @given(case=strategy)
        @settings(
            max_examples=MAX_EXAMPLES,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def run(case: Any) -> None:
            response = case.call(base_url=target.server.url, headers=headers)
            statuses[response.status_code] += 1
            case.validate_response(response, checks=CHECKS, headers=headers)

        try:
            run()
        except Unsatisfiable:
            # an operation without inputs has nothing to break in negative mode
            assert mode is GenerationMode.NEGATIVE and path == "/healthz"
    assert statuses, "nothing was sent"
    assert all(status < 500 for status in statuses)
