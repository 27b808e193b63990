"""Owns sending an alert by e-mail through the configured SMTP server (smtplib, with an
optional STARTTLS and AUTH from a credentials file).

Every header is made safe here again, whatever was checked at input (defence in depth: a
name stored before control characters were refused must not break sending): a recipient
that is not a whole plain address fails the alert, and control and line-separator
characters in the subject are replaced."""

from __future__ import annotations

import json
import smtplib
import ssl
from dataclasses import dataclass
from email.message import EmailMessage
from pathlib import Path
from typing import Any

from schedctl import errors, limits
from schedctl.alerts.model import EMAIL_ADDRESS

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
    """The e-mail of one alert: a one-line subject, the alert JSON as the body. Raises
    Undeliverable for a recipient that is not a whole plain address."""
    for address in recipients:
        if not EMAIL_ADDRESS.fullmatch(address):
            raise Undeliverable(f"not an e-mail address: {limits.describe(address)}")
    mail = EmailMessage()
    mail["From"] = header_text(sender)
    mail["To"] = ", ".join(recipients)
    job = alert.get("job_id")
    if alert.get("job_name"):
        job = f"{alert['job_name']} ({job})"
    mail["Subject"] = header_text(
        f"[scheduled] {alert.get('alert')}: job {job} (tenant {alert.get('tenant_id')})"
    )
    # ASCII JSON (every other character escaped): the body cannot break lines either
    mail.set_content(json.dumps(alert, indent=2, sort_keys=True) + "\n")
    return mail


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
