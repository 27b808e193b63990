"""`schedctl cron next`: table and JSON output, DST notes, and clean errors."""

from __future__ import annotations

import json
from typing import Any

from typer.testing import CliRunner

from schedctl.cli.cron_cmd import app

runner = CliRunner()
WIDE = {"COLUMNS": "200"}


def _berlin_json(cron: str, start: str, *count: str) -> Any:
    """The JSON rows of `cron next CRON` in Europe/Berlin from START, COUNT the count flag."""
    result = runner.invoke(
        app, ["next", cron, "--tz", "Europe/Berlin", "--from", start, *count, "--output", "json"]
    )
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_json_output_with_dst_notes() -> None:
    rows = _berlin_json("30 2 * * *", "2026-03-28T00:00:00Z", "-n", "3")
    assert [r["utc"] for r in rows] == [
        "2026-03-28T01:30:00Z",
        "2026-03-29T01:00:00Z",
        "2026-03-30T00:30:00Z",
    ]
    assert [r["local"] for r in rows] == [
        "2026-03-28T02:30:00+01:00",
        "2026-03-29T03:00:00+02:00",
        "2026-03-30T02:30:00+02:00",
    ]
    assert rows[0]["note"] is None and rows[2]["note"] is None
    assert "02:30" in rows[1]["note"] and "gap" in rows[1]["note"]


def test_json_marks_second_occurrence_for_every_hour_jobs() -> None:
    rows = _berlin_json("0 * * * *", "2026-10-24T23:30:00Z", "--count", "3")
    assert [r["local"] for r in rows] == [
        "2026-10-25T02:00:00+02:00",
        "2026-10-25T02:00:00+01:00",
        "2026-10-25T03:00:00+01:00",
    ]
    assert rows[0]["note"] is None
    assert "2nd occurrence" in rows[1]["note"]


def test_table_output() -> None:
    result = runner.invoke(
        app,
        ["next", "@daily", "--tz", "Asia/Kolkata", "--from", "2026-01-01T00:00:00+05:30"],
        env=WIDE,
    )
    assert result.exit_code == 0, result.output
    assert "utc" in result.stdout and "local" in result.stdout
    assert "2026-01-01T18:30:00Z" in result.stdout
    assert "2026-01-02T00:00:00+05:30" in result.stdout
    assert result.stdout.count("+05:30") == 5  # default count


def test_defaults_to_utc_and_now() -> None:
    result = runner.invoke(app, ["next", "* * * * *", "-n", "2", "--output", "json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert len(rows) == 2
    assert all(r["local"].endswith("+00:00") and r["utc"].endswith("Z") for r in rows)


def test_invalid_zone() -> None:
    result = runner.invoke(app, ["next", "0 0 * * *", "--tz", "Mars/Olympus"])
    assert result.exit_code == 2
    assert "timezone: unknown time zone 'Mars/Olympus'" in result.stderr
    assert "Traceback" not in result.output
    assert result.stdout == ""


def test_invalid_cron() -> None:
    result = runner.invoke(app, ["next", "0 0 30 2 *"])
    assert result.exit_code == 2
    assert result.stderr.startswith("cron: can never fire")
    assert "Traceback" not in result.output


def test_invalid_from() -> None:
    result = runner.invoke(app, ["next", "0 0 * * *", "--from", "2026-01-01T00:00:00"])
    assert result.exit_code == 2
    assert "from: " in result.stderr and "UTC offset" in result.stderr


def test_count_bounds() -> None:
    assert runner.invoke(app, ["next", "* * * * *", "-n", "0"]).exit_code != 0
    assert runner.invoke(app, ["next", "* * * * *", "-n", "1001"]).exit_code != 0
    result = runner.invoke(app, ["next", "* * * * *", "-n", "1000", "--output", "json"])
    assert result.exit_code == 0
    assert len(json.loads(result.stdout)) == 1000
