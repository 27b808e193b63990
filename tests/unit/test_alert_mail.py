"""Owns the tests of an alert's e-mail as built (schedctl.delivery.email.message): the
plain-text body first, the times in UTC and the job's zone, the tenant's text made
harmless, the JSON attached, and the no-success alert's shape."""

from __future__ import annotations

import json
from typing import Any

from schedctl.delivery.email import message

ALERT: dict[str, Any] = {
    "alert": "failure",
    "tenant_id": "tenant-acme",
    "tenant_name": "acme",
    "job_id": "0f3a" * 8,
    "job_name": "backup",
    "scheduled_at": "2026-07-01T06:00:00+00:00",
    "started_at": "2026-07-01T06:00:01+00:00",
    "finished_at": "2026-07-01T06:00:09+00:00",
    "timezone": "Europe/Berlin",
    "attempt": 1,
    "max_attempts": 3,
    "final": False,
    "exit_code": 2,
    "error": "exit code 2",
    "host": "web1",
    "worker": "web1:42:abcd",
    "command": "defined on the host in /etc/scheduled/jobs.d/crontab.toml (job backup)",
    "output_tail": "tar: /srv: Cannot open\n\x1b[31mred\x1b[0m\u2028forged",
    "at": "2026-07-01T06:00:09+00:00",
}


def _parts(alert: dict[str, Any]) -> tuple[str, str, dict[str, Any]]:
    mail = message("s@example.com", ["ops@example.com"], alert)
    text, attached = mail.get_payload()
    body = text.get_content()
    return str(mail["Subject"]), body, json.loads(attached.get_content())


def test_the_body_is_text_first_with_both_zones_and_the_json_attached() -> None:
    subject, body, attached = _parts(ALERT)
    assert subject == "[scheduled] job backup failed (attempt 1 of 3): exit code 2 - tenant acme"
    assert body.startswith("Job backup of tenant acme failed.\n")
    assert "scheduled:  2026-07-01 06:00:00 UTC (2026-07-01 08:00:00 CEST Europe/Berlin)" in body
    assert "attempt:    1 of 3\n" in body and "exit code:  2\n" in body
    assert "host:       web1 (worker web1:42:abcd)" in body
    assert "/etc/scheduled/jobs.d/crontab.toml" in body
    # the output's escape sequences and line separators cannot reach a terminal or forge
    assert "\x1b" not in body and "\u2028" not in body and "| tar: /srv: Cannot open" in body
    assert f"See more: schedctl logs {'0f3a' * 8} 2026-07-01T06:00:00Z" in body
    assert attached == ALERT


def test_a_no_success_alert_says_so_and_points_at_job_why() -> None:
    alert = {
        "alert": "no_success",
        "tenant_id": "tenant-acme",
        "job_id": "0f3a" * 8,
        "job_name": None,
        "scheduled_at": "2026-07-01T06:00:00+00:00",
        "attempt": None,
        "error": "no successful run since 2026-07-01T06:00:00+00:00",
        "at": "2026-07-02T06:00:00+00:00",
    }
    subject, body, _ = _parts(alert)
    assert subject == f"[scheduled] job {'0f3a' * 8} has not succeeded - tenant tenant-acme"
    assert "Last lines of output" not in body and "started:" not in body
    assert f"See more: schedctl job why {'0f3a' * 8}" in body
