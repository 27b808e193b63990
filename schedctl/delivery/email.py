"""Owns sending an alert by e-mail through the configured SMTP server (smtplib, with an
optional STARTTLS and AUTH from a credentials file), and the mail itself: a plain-text body
an operator can act on (job and tenant by name, host, command, exit code, attempt of max,
times in UTC and the job's zone, the output's last lines, the command to see more) with the
alert JSON attached.

Every header is made safe here again, whatever was checked at input (defence in depth: a
name stored before control characters were refused must not break sending): a recipient
that is not a whole plain address fails the alert, and control and line-separator
characters in the subject are replaced."""

from __future__ import annotations

import json
import shlex
import smtplib
import ssl
from dataclasses import dataclass
from datetime import UTC, datetime
from email.message import EmailMessage
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from schedctl.core import errors, limits
from schedctl.domain.alerts.model import EMAIL_ADDRESS
from schedctl.scheduling.timeparse import format_instant

DEFAULT_TIMEOUT_SECONDS = 10.0


@dataclass(frozen=True)
class SmtpSettings:
    host: str | None
    port: int = 25
    sender: str = "scheduled@localhost"
    starttls: bool = False
    credentials_file: str | None = None  # one line "user:password"
    timeout: float = DEFAULT_TIMEOUT_SECONDS


def _credentials(path: str) -> tuple[str, str]:
    try:
        text = Path(path).read_text().strip()
    except OSError as exc:
        raise errors.ConfigError(
            f"cannot read: {exc.strerror}", field="smtp_credentials_file"
        ) from exc
    user, sep, password = text.partition(":")
    if not sep or not user:
        raise errors.ConfigError("must hold one line user:password", field="smtp_credentials_file")
    return user, password


class Undeliverable(Exception):
    """The alert can never be mailed as it is (a recipient that is not a plain address):
    retrying cannot help."""


def header_text(value: Any) -> str:
    """`value` as one safe header line: every control and line-separator character
    replaced by U+FFFD (Python's e-mail package refuses them, U+2028 and U+0085 too)."""
    return limits.CONTROL_CHARS.sub("\ufffd", str(value))


def message(sender: str, recipients: list[str], alert: dict[str, Any]) -> EmailMessage:
    """The e-mail of one alert: a one-line subject naming the job and tenant, a plain-text
    body an operator can act on (what failed, where, when, its output's end and the
    command to see more) and the alert JSON attached. Raises Undeliverable for a
    recipient that is not a whole plain address."""
    for address in recipients:
        if not EMAIL_ADDRESS.fullmatch(address):
            raise Undeliverable(f"not an e-mail address: {limits.describe(address)}")
    mail = EmailMessage()
    mail["From"] = header_text(sender)
    mail["To"] = ", ".join(recipients)
    mail["Subject"] = header_text(subject(alert))
    mail.set_content(text_body(alert))
    # ASCII JSON (every other character escaped), for tools: the same body a webhook gets
    mail.add_attachment(
        (json.dumps(alert, indent=2, sort_keys=True) + "\n").encode("ascii"),
        maintype="application",
        subtype="json",
        filename="alert.json",
    )
    return mail


_WHAT = {
    "dead_letter": "failed for good (dead-lettered)",
    "failure": "failed",
    "no_success": "has not succeeded",
}


def _name(alert: dict[str, Any], name_key: str, id_key: str) -> str:
    return str(alert.get(name_key) or alert.get(id_key) or "?")


def subject(alert: dict[str, Any]) -> str:
    """`[scheduled] job backup failed (attempt 3 of 3): exit code 3 - tenant acme`."""
    kind = str(alert.get("alert"))
    text = f"[scheduled] job {_name(alert, 'job_name', 'job_id')} {_WHAT.get(kind, kind)}"
    attempt = _attempt(alert)
    if attempt:
        text += f" ({attempt})"
    if alert.get("error") and kind != "no_success":
        text += f": {str(alert['error'])[:80]}"
    return f"{text} - tenant {_name(alert, 'tenant_name', 'tenant_id')}"


def _attempt(alert: dict[str, Any]) -> str:
    attempt, most = alert.get("attempt"), alert.get("max_attempts")
    if attempt is None:
        return ""
    text = f"attempt {attempt} of {most}" if most else f"attempt {attempt}"
    return text + (", the last" if alert.get("final") else "")


def _clean(value: Any) -> str:
    """One line of the tenant's text (a name, an error, an output line) as the body shows
    it: control characters replaced, so nothing can forge a line or a terminal sequence."""
    return limits.CONTROL_CHARS.sub("\ufffd", str(value))


def _times(value: Any, zone: str | None) -> str:
    """An ISO time as UTC, and in the job's zone when it has one other than UTC."""
    if not value:
        return "-"
    try:
        at = datetime.fromisoformat(str(value)).astimezone(UTC)
    except ValueError:
        return _clean(value)
    text = at.strftime("%Y-%m-%d %H:%M:%S UTC")
    if zone and zone != "UTC":
        try:
            local = at.astimezone(ZoneInfo(zone))
        except (ValueError, KeyError, ZoneInfoNotFoundError):
            return text
        text += f" ({local.strftime('%Y-%m-%d %H:%M:%S %Z')} {zone})"
    return text


def text_body(alert: dict[str, Any]) -> str:
    """The plain-text body: the facts first, then the output's end and where to see more."""
    kind = str(alert.get("alert"))
    job, tenant = _name(alert, "job_name", "job_id"), _name(alert, "tenant_name", "tenant_id")
    zone = alert.get("timezone") if isinstance(alert.get("timezone"), str) else None
    lines = [_clean(f"Job {job} of tenant {tenant} {_WHAT.get(kind, kind)}."), ""]
    rows: list[tuple[str, Any]] = [
        ("job", f"{job} (id {alert.get('job_id')})"),
        ("tenant", f"{tenant} (id {alert.get('tenant_id')})"),
    ]
    if alert.get("host") or alert.get("worker"):
        rows.append(("host", f"{alert.get('host') or '?'} (worker {alert.get('worker')})"))
    if alert.get("command"):
        rows.append(("command", alert["command"]))
    if alert.get("exit_code") is not None:
        rows.append(("exit code", alert["exit_code"]))
    if alert.get("error") and alert["error"] != f"exit code {alert.get('exit_code')}":
        rows.append(("error", alert["error"]))
    if _attempt(alert):
        rows.append(("attempt", _attempt(alert).removeprefix("attempt ")))
    rows.append(("scheduled", _times(alert.get("scheduled_at"), zone)))
    if kind != "no_success":
        rows.append(("started", _times(alert.get("started_at"), zone)))
        rows.append(("finished", _times(alert.get("finished_at"), zone)))
    if zone:
        rows.append(("time zone", zone))
    lines += [f"  {label + ':':<11} {_clean(value)}" for label, value in rows]
    output = alert.get("output_tail")
    if kind != "no_success":
        lines.append("")
        if output:
            lines.append("Last lines of output:")
            lines += [f"  | {_clean(line)}" for line in str(output).splitlines()]
        else:
            lines.append("No output was recorded.")
    scheduled = alert.get("scheduled_at")
    if kind != "no_success" and alert.get("job_id") and scheduled:
        try:
            run = format_instant(datetime.fromisoformat(str(scheduled)))
        except ValueError:
            run = str(scheduled)
        more = f"schedctl logs {shlex.quote(str(alert['job_id']))} {shlex.quote(run)}"
        lines += ["", f"See more: {_clean(more)}"]
    else:
        lines += ["", f"See more: schedctl job why {shlex.quote(str(alert.get('job_id')))}"]
    lines += ["", "The alert as JSON is attached (alert.json)."]
    return "\n".join(lines) + "\n"


def send(settings: SmtpSettings, recipients: list[str], alert: dict[str, Any]) -> str | None:
    """Send the alert; None on success, else why it failed (the caller retries). Raises
    Undeliverable when it can never be sent as it is."""
    if not settings.host:
        return "no SMTP server configured (smtp_host)"
    mail = message(settings.sender, recipients, alert)
    try:
        with smtplib.SMTP(settings.host, settings.port, timeout=settings.timeout) as smtp:
            if settings.starttls:
                smtp.starttls(context=ssl.create_default_context())
            if settings.credentials_file:
                smtp.login(*_credentials(settings.credentials_file))
            smtp.send_message(mail)
    except (OSError, smtplib.SMTPException, errors.ConfigError) as exc:
        return f"SMTP {settings.host}:{settings.port}: {type(exc).__name__}: {exc}"
    return None
