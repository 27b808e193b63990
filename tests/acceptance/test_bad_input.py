"""Owns the property tests of bad numbers, ids, cursors, durations and payloads (issue 8,
item 10): `schedctl` refuses each with exit 2 (3: not found), one `error:` line naming the
field, no traceback and no "internal error", and writes nothing; the REST API answers 4xx
for the same values. On SQLite and Postgres (where a 25-digit id overflows BIGINT)."""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from sqlalchemy import func, select
from typer.testing import CliRunner

from schedctl.app.service import Scheduler
from schedctl.cli.app import app
from schedctl.core import limits
from schedctl.storage.db import schema
from scheduled_d.api.server import ApiServer
from tests.integration.api_support import job_body

runner = CliRunner()
EXAMPLES = settings(
    max_examples=50,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
COUNTED = (
    schema.tenants,
    schema.api_tokens,
    schema.jobs,
    schema.runs,
    schema.outbox,
    schema.dead_letters,
    schema.audit_log,
)

# -- bad values --------------------------------------------------------------------------

NON_ASCII_DIGIT = st.characters(categories=["Nd"]).filter(lambda c: not c.isascii())
# "٣", "1٢", "٤٥": digits int() and str.isdigit() take, but nobody types in a schedule
non_ascii_number = st.builds(
    lambda head, digit, tail: head + digit + tail,
    st.sampled_from(["", "1", "2"]),
    NON_ASCII_DIGIT,
    st.text(alphabet=NON_ASCII_DIGIT, max_size=3),
)
huge_int = st.one_of(
    st.integers(min_value=2**63, max_value=10**40).map(str),
    st.integers(min_value=-(10**40), max_value=-(2**63) - 1).map(str),
    # past Python's 4,300-digit int() limit too
    st.integers(min_value=20, max_value=6000).map(lambda n: "9" * n),
)
float_text = st.one_of(
    st.sampled_from(["1e20", "1E5", "1.5", "0.5", "inf", "nan", "-inf", "0x10", "1_000", ""]),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
)
bad_int = st.one_of(huge_int, float_text, non_ascii_number, st.just("9" * 5000))
bad_duration = st.one_of(
    st.tuples(non_ascii_number, st.sampled_from(["", "s", "m", "h", "d"])).map("".join),
    non_ascii_number.map(lambda n: f"PT{n}M"),
    huge_int.filter(lambda s: not s.startswith("-")).map(lambda n: n + "s"),
    st.just("9" * 5000 + "m"),
    st.sampled_from(["1e20s", "infs", "nan", "P1Y", "-5m"]),
)


def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


bad_payload = st.one_of(
    st.integers(min_value=limits.MAX_PAYLOAD_DEPTH + 1, max_value=30_000).map(_deep),
    st.integers(min_value=limits.MAX_PAYLOAD_DEPTH + 1, max_value=5_000).map(
        lambda d: '{"a": ' + _deep(d) + "}"
    ),
    huge_int.map(lambda n: '{"n": ' + n + "}"),
    st.integers(min_value=20, max_value=6000).map(lambda n: "[-" + "9" * n + "]"),
    st.sampled_from(['{"x": NaN}', "[Infinity]", '{"x": -Infinity}', "1e999", "[-1e400]"]),
)

# option -> the field its error names (the REST body's name, as jobspec says it)
INT_OPTIONS = {"--max-attempts": "retry.max_attempts", "--max-concurrency": "max_concurrency"}
DURATION_OPTIONS = {
    "--in": "delay",
    "--every": "interval",
    "--window": "window",
    "--grace": "grace",
    "--timeout": "timeout",
}


_OPEN: dict[str, Scheduler] = {}


def counts(db_url: str) -> dict[str, int]:
    with _OPEN[db_url].store.read() as connection:
        return {
            table.name: connection.execute(select(func.count()).select_from(table)).scalar_one()
            for table in COUNTED
        }


def refused(argv: list[str], db_url: str, field: str, codes: tuple[int, ...] = (2,)) -> None:
    result = runner.invoke(app, ["--db", db_url, *argv])
    output = result.output
    assert "Traceback" not in output and "internal error" not in output, output
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"unhandled {result.exception!r}\n{output}")
    assert result.exit_code in codes, (argv, output)
    assert result.stderr.startswith("error: "), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert field in result.stderr, (field, result.stderr)


def _with_acme(db_url: str) -> Iterator[str]:
    result = runner.invoke(app, ["--db", db_url, "tenant", "create", "acme"])
    assert result.exit_code == 0, result.output
    _OPEN[db_url] = Scheduler.open(db_url)
    try:
        yield db_url
    finally:
        _OPEN.pop(db_url).close()


@pytest.fixture
def acme_db(db_url: str) -> Iterator[str]:
    """SQLite and Postgres: where ids and cursors reach the database."""
    yield from _with_acme(db_url)


@pytest.fixture
def acme_sqlite(sqlite_url: str) -> Iterator[str]:
    """SQLite only: the values are refused before any query (the time budget)."""
    yield from _with_acme(sqlite_url)


def _job_create(*options: str) -> list[str]:
    return ["job", "create", "--tenant", "acme", "--queue", "q", *options]


# -- schedctl job create -----------------------------------------------------------------


@EXAMPLES
@given(option=st.sampled_from(sorted(INT_OPTIONS)), value=bad_int)
def test_job_create_refuses_bad_integers(acme_sqlite: str, option: str, value: str) -> None:
    before = counts(acme_sqlite)
    refused(_job_create("--in", "10m", f"{option}={value}"), acme_sqlite, INT_OPTIONS[option])
    assert counts(acme_sqlite) == before


@EXAMPLES
@given(option=st.sampled_from(sorted(DURATION_OPTIONS)), value=bad_duration)
def test_job_create_refuses_bad_durations(acme_sqlite: str, option: str, value: str) -> None:
    before = counts(acme_sqlite)
    schedule = [] if option in ("--in", "--every") else ["--in", "10m"]
    argv = _job_create(*schedule, f"{option}={value}")
    refused(argv, acme_sqlite, DURATION_OPTIONS[option])
    assert counts(acme_sqlite) == before


@EXAMPLES
@given(payload=bad_payload, from_file=st.booleans())
def test_job_create_refuses_bad_payloads(
    acme_sqlite: str, payload: str, from_file: bool, tmp_path_factory: pytest.TempPathFactory
) -> None:
    before = counts(acme_sqlite)
    if from_file:
        path = tmp_path_factory.mktemp("payload") / "payload.json"
        path.write_text(payload)
        options = ["--payload-file", str(path)]
    else:
        options = [f"--payload={payload}"]
    refused(_job_create("--in", "10m", *options), acme_sqlite, "payload")
    assert counts(acme_sqlite) == before


def test_arabic_indic_minutes_are_not_three_minutes(acme_sqlite: str) -> None:
    refused(_job_create("--in", "٣m"), acme_sqlite, "delay")
    refused(_job_create("--in", "PT٣M"), acme_sqlite, "delay")
    refused(_job_create("--in", "10m", "--max-concurrency", "1e20"), acme_sqlite, "max_concurrency")
    assert counts(acme_sqlite)["jobs"] == 0


def test_the_bounds_themselves_are_accepted(acme_sqlite: str) -> None:
    result = runner.invoke(
        app,
        [
            "--db",
            acme_sqlite,
            *_job_create(
                "--in",
                "366d",
                "--max-attempts",
                str(limits.MAX_ATTEMPTS),
                "--max-concurrency",
                str(limits.MAX_CONCURRENCY),
                "--payload",
                json.dumps({"min": limits.INT64_MIN, "max": limits.INT64_MAX, "f": 1e308}),
            ),
            "-o",
            "json",
        ],
    )
    assert result.exit_code == 0, result.output
    job = json.loads(result.stdout)
    assert job["payload"] == {"min": -(2**63), "max": 2**63 - 1, "f": 1e308}
    assert job["max_concurrency"] == limits.MAX_CONCURRENCY


# -- ids and cursors ---------------------------------------------------------------------


def _cursor(text: str) -> str:
    return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


def _is_job_id_cursor(value: str) -> bool:
    try:
        raw = base64.urlsafe_b64decode(value + "=" * (-len(value) % 4)).decode()
    except ValueError:
        return False
    return re.fullmatch("[0-9a-f]{1,40}", raw) is not None


bad_id = st.one_of(bad_int, st.sampled_from(["0", "-1", "abc", "1.0", " ", "1 2"]))
bad_cursor = st.one_of(
    bad_int.filter(bool),  # an empty cursor is the first page
    # well-formed base64 of what no server issues: huge or non-ASCII numbers, junk
    st.one_of(huge_int, non_ascii_number, st.just("0"), st.just("-5")).map(_cursor),
    st.text(min_size=limits.MAX_CURSOR_LENGTH + 1, max_size=limits.MAX_CURSOR_LENGTH + 50),
    st.just("A" * 5000),
)
ID_COMMANDS = (
    ["dlq", "show"],
    ["dlq", "replay"],
    ["dlq", "purge"],
)
CURSOR_COMMANDS = (
    ["audit"],
    ["dlq", "list"],
    ["job", "list"],
    ["runs", "0123456789abcdef"],
)
LIMIT_COMMANDS = (["audit"], ["dlq", "list"], ["job", "list"], ["runs", "0123456789abcdef"])


@EXAMPLES
@given(command=st.sampled_from(ID_COMMANDS), value=bad_id)
def test_bad_ids_are_invalid(acme_db: str, command: list[str], value: str) -> None:
    before = counts(acme_db)
    refused([*command, "--", value], acme_db, "id")
    assert counts(acme_db) == before


@EXAMPLES
@given(command=st.sampled_from(CURSOR_COMMANDS), value=bad_cursor)
def test_bad_cursors_are_invalid(acme_db: str, command: list[str], value: str) -> None:
    # a job list cursor is a job id (hex): the base64 of a number of up to 40 digits is one
    assume(command != ["job", "list"] or not _is_job_id_cursor(value))
    before = counts(acme_db)
    # runs of an unknown job: 3 (not found) is as good an answer as 2 for its cursor
    codes = (2, 3) if command[0] == "runs" else (2,)
    field = "cursor" if codes == (2,) else ""
    refused([*command, f"--cursor={value}"], acme_db, field, codes)
    assert counts(acme_db) == before


@EXAMPLES
@given(command=st.sampled_from(LIMIT_COMMANDS), value=bad_id)
def test_bad_limits_are_invalid(acme_sqlite: str, command: list[str], value: str) -> None:
    refused([*command, f"--limit={value}"], acme_sqlite, "limit")


def test_dlq_show_of_25_digits_and_a_missing_id(acme_db: str) -> None:
    refused(["dlq", "show", "1234567890123456789012345"], acme_db, "id")
    refused(["audit", "--cursor", "1234567890123456789012345"], acme_db, "cursor")
    refused(["audit", "--cursor", _cursor("1234567890123456789012345")], acme_db, "cursor")
    refused(["dlq", "show", str(limits.MAX_ID)], acme_db, "dead letter", codes=(3,))


@EXAMPLES
@given(
    argv=st.one_of(
        bad_int.map(lambda v: ["tenant", "quota", "acme", f"--max-jobs={v}"]),
        bad_int.map(lambda v: ["tenant", "quota", "acme", f"--create-rate={v}"]),
        bad_int.map(lambda v: ["tenant", "delivery", "acme", f"--concurrency={v}"]),
        bad_int.map(lambda v: ["tenant", "delivery", "acme", f"--rate={v}"]),
        bad_int.map(lambda v: ["cron", "next", "* * * * *", f"-n={v}"]),
        bad_duration.map(lambda v: ["dlq", "purge", "--all", f"--older-than={v}"]),
        st.just(["dlq", "purge", "--all", "--older-than=999999d"]),
    )
)
def test_tenant_settings_counts_and_ages_refuse_bad_values(
    acme_sqlite: str, argv: list[str]
) -> None:
    before = counts(acme_sqlite)
    field = {
        "--max-jobs": "max_jobs",
        "--create-rate": "create_rate_per_minute",
        "--concurrency": "delivery_concurrency",
        "--rate": "dispatch_rate_per_second",
        "-n": "count",
        "--older-than": "older_than",
    }[argv[-1].split("=")[0]]
    refused(argv, acme_sqlite, field)
    assert counts(acme_sqlite) == before


# -- the REST API ------------------------------------------------------------------------


class Client:
    """The API served by a real uvicorn on 127.0.0.1, with acme's token."""

    def __init__(self, url: str, token: str) -> None:
        self.url = url
        self.session = requests.Session()
        self.session.headers["Authorization"] = f"Bearer {token}"

    def get(self, path: str, params: dict[str, str] | None = None) -> requests.Response:
        return self.session.get(self.url + path, params=params, timeout=30)

    def post(self, path: str, raw: str) -> requests.Response:
        return self.session.post(
            self.url + path,
            data=raw.encode("utf-8", "surrogatepass"),
            headers={"Content-Type": "application/json"},
            timeout=30,
        )


@pytest.fixture
def api(acme_db: str) -> Iterator[Client]:
    scheduler = _OPEN[acme_db]
    token = scheduler.new_token("acme", actor="test")
    server = ApiServer(scheduler, "127.0.0.1:0", access_log=False)
    server.start()
    try:
        yield Client(server.url, token)
    finally:
        server.stop()


def _body(**overrides: Any) -> dict[str, Any]:
    return job_body(
        **{"schedule": {"delay": "PT10M"}, "target": {"type": "queue", "name": "q"}, **overrides}
    )


def _post(client: Client, raw: str) -> requests.Response:
    return client.post("/v1/jobs", raw)


def _assert_4xx(response: requests.Response, field: str | None = None) -> None:
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:300])
    error = response.json()["error"]
    if field is not None:
        assert error["field"] == field, error


@EXAMPLES
@given(payload=bad_payload)
def test_api_refuses_bad_payloads_naming_the_field(api: Client, acme_db: str, payload: str) -> None:
    before = counts(acme_db)
    raw = '{"schedule": {"delay": "PT10M"}, "target": {"type": "queue", "name": "q"}, '
    response = _post(api, raw + '"payload": ' + payload + "}")
    _assert_4xx(response, "payload")
    assert response.status_code == 422
    assert counts(acme_db) == before


@EXAMPLES
@given(
    key=st.sampled_from(["max_concurrency", "retry", "window", "grace", "timeout", "schedule"]),
    value=st.one_of(huge_int, st.sampled_from(["1e20", "-1e400", "NaN", "Infinity"])),
)
def test_api_refuses_huge_numbers_in_every_field(
    api: Client, acme_db: str, key: str, value: str
) -> None:
    before = counts(acme_db)
    fields = {
        "max_concurrency": ("max_concurrency", value),
        "retry": ("retry.max_attempts", '{"max_attempts": ' + value + "}"),
        "window": ("window", value),
        "grace": ("grace", value),
        "timeout": ("timeout", value),
        "schedule": ("interval", '{"every": ' + value + "}"),
    }
    field, text = fields[key]
    body = json.dumps({k: v for k, v in _body().items() if k != key})
    response = _post(api, body[:-1] + f', "{key}": {text}' + "}")
    _assert_4xx(response, field)
    assert counts(acme_db) == before


@EXAMPLES
@given(
    path=st.one_of(
        bad_cursor.map(lambda c: ("/v1/jobs", {"cursor": c})),
        bad_cursor.map(lambda c: ("/v1/jobs/0123abcd/runs", {"cursor": c})),
        bad_id.filter(bool).map(lambda v: ("/v1/jobs", {"limit": v})),
        # "" would be /v1/jobs/, which redirects to the list
        bad_id.filter(bool).map(lambda v: (f"/v1/jobs/{v}", {})),
        huge_int.map(lambda v: (f"/v1/jobs/{v}/runs", {})),
    )
)
def test_api_refuses_bad_ids_cursors_and_limits(
    api: Client, path: tuple[str, dict[str, str]]
) -> None:
    url, params = path
    assume(not (url == "/v1/jobs" and _is_job_id_cursor(params.get("cursor", "-"))))
    response = api.get(url, params=params)
    assert response.status_code >= 400, (url, params)
    _assert_4xx(response)
    assert response.status_code != 404 or not params, response.text  # a bad query is 422


@EXAMPLES
@given(
    key=st.sampled_from(["name", "schedule", "target", "retry", "window", "misfire_policy"]),
    depth=st.integers(min_value=limits.MAX_PAYLOAD_DEPTH, max_value=3000),
    wrap=st.sampled_from(["[]", "{}"]),
)
def test_api_refuses_deep_values_in_any_field(
    api: Client, acme_db: str, key: str, depth: int, wrap: str
) -> None:
    before = counts(acme_db)
    opening, closing = ('{"k": ', "}") if wrap == "{}" else ("[", "]")
    value = opening * depth + "1" + closing * depth
    body = json.dumps({k: v for k, v in _body().items() if k != key})
    response = _post(api, body[:-1] + f', "{key}": {value}' + "}")
    _assert_4xx(response)
    assert counts(acme_db) == before


def test_api_deep_or_huge_bodies_are_4xx(api: Client, acme_db: str) -> None:
    before = counts(acme_db)
    deep = _post(api, _deep(100_000))
    _assert_4xx(deep, "body")
    huge = _post(api, json.dumps(_body())[:-1] + ', "payload": ' + "9" * 5000 + "}")
    _assert_4xx(huge, "payload")
    bad = _post(api, json.dumps(_body(schedule={"delay": "PT٣M"})))
    _assert_4xx(bad, "delay")
    concurrency = _post(api, json.dumps(_body(max_concurrency=10**20)))
    _assert_4xx(concurrency, "max_concurrency")
    assert counts(acme_db) == before


# -- the documented table ----------------------------------------------------------------


def test_every_bound_is_documented() -> None:
    root = Path(__file__).resolve().parents[2]
    documented = (root / "docs" / "jobs.md").read_text()  # its "Limits" table
    man = (root / "man" / "schedctl.1").read_text()
    for what, _where, accepted in limits.BOUNDS:
        assert f"| {what} |" in documented and f"| {accepted} |" in documented, what
        assert f".B {what}\n" in man and accepted.replace("-", "\\-") in man, what


def test_overlap_and_run_limits_refused_by_name_and_nothing_changes(acme_db: str) -> None:
    refused(_job_create("--every", "1m", "--overlap", "never"), acme_db, "overlap")
    refused(_job_create("--every", "1m", "--tasks-max", "0"), acme_db, "tasks_max")
    refused(_job_create("--every", "1m", "--memory-max", "12X"), acme_db, "memory_max")
    refused(_job_create("--every", "1m", "--cpu-weight", "10001"), acme_db, "cpu_weight")
    http = ["job", "create", "--tenant", "acme", "--url", "https://example.com/h"]
    refused([*http, "--every", "1m", "--overlap", "skip"], acme_db, "overlap")
    assert counts(acme_db)["jobs"] == 0
    created = runner.invoke(
        app,
        ["--db", acme_db, *_job_create("--every", "1m", "--overlap", "skip",
                                       "--memory-max", "512M", "--name", "o"), "-o", "json"],
    )  # fmt: skip
    assert created.exit_code == 0, created.output
    job = json.loads(created.stdout)
    assert (job["overlap"], job["memory_max"], job["tasks_max"]) == ("skip", 512 << 20, None)
    before = counts(acme_db)
    update = ["job", "update", job["job_id"], "--tenant", "acme"]
    refused([*update, "--overlap", "sometimes"], acme_db, "overlap")
    refused([*update, "--url", "https://example.com/h"], acme_db, "overlap")
    assert counts(acme_db) == before
    shown = runner.invoke(app, ["--db", acme_db, "job", "show", job["job_id"], "--tenant",
                                "acme", "-o", "json"])  # fmt: skip
    assert json.loads(shown.stdout)["overlap"] == "skip"
    changed = runner.invoke(app, ["--db", acme_db, *update, "--overlap", "replace",
                                  "--memory-max", "none", "-o", "json"])  # fmt: skip
    assert changed.exit_code == 0, changed.output
    assert (json.loads(changed.stdout)["overlap"], json.loads(changed.stdout)["memory_max"]) == (
        "replace", None)  # fmt: skip
