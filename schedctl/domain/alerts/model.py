"""Owns the alert settings of a job or tenant (`"alerts": {...}`): parsing, checking and
the JSON form stored in alert_settings, and the alert body sent to every channel."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any

from schedctl.core import errors, limits
from schedctl.scheduling.timeparse import parse_duration

KINDS = ("dead_letter", "failure")  # what `on` may list; no_success is set by its duration
NO_SUCCESS = "no_success"
WEBHOOK, EMAIL, COMMAND = "webhook", "email", "command"
MAX_EMAILS = 10
# an address matched whole (fullmatch: "$" would let "a@b.c\n" through) and ASCII only: the
# local part RFC 5322's atext and dots, the domain DNS labels; nothing that can end a mail
# header line or change its meaning (no space, quote, comma, angle bracket or control)
EMAIL_ADDRESS = re.compile(
    r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~.-]{1,64}@(?=[A-Za-z0-9.-]{1,253}\Z)"
    r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*",
    re.ASCII,
)
_KEYS = {"on", "webhook", "email", "command", "no_success"}


@dataclass(frozen=True)
class AlertConfig:
    """Where a job's alerts go and on what. Empty (no channel) means no alerts."""

    on: tuple[str, ...] = ("dead_letter",)
    webhook: str | None = None
    email: tuple[str, ...] = ()
    command: bool = False
    no_success: timedelta | None = None

    @property
    def channels(self) -> list[tuple[str, str]]:
        """(channel, destination) of each configured channel; command's is set per job."""
        result: list[tuple[str, str]] = []
        if self.webhook:
            result.append((WEBHOOK, self.webhook))
        if self.email:
            result.append((EMAIL, ",".join(self.email)))
        if self.command:
            result.append((COMMAND, ""))
        return result

    def to_dict(self) -> dict[str, Any]:
        result: dict[str, Any] = {"on": list(self.on)}
        if self.webhook:
            result["webhook"] = self.webhook
        if self.email:
            result["email"] = list(self.email)
        if self.command:
            result["command"] = True
        if self.no_success is not None:
            result["no_success"] = f"PT{int(self.no_success.total_seconds())}S"
        return result


def parse_alerts(value: Any, field_name: str = "alerts") -> AlertConfig:
    """The AlertConfig of a JSON object; a ValidationError naming the field otherwise."""
    if not isinstance(value, dict):
        raise errors.ValidationError("must be an object", field=field_name)
    unknown = sorted(set(value) - _KEYS)
    if unknown:
        raise errors.ValidationError(
            f"unknown key {unknown[0]!r} (known: {', '.join(sorted(_KEYS))})", field=field_name
        )
    on = value.get("on", ["dead_letter"])
    if not isinstance(on, list) or not all(isinstance(k, str) and k in KINDS for k in on):
        raise errors.ValidationError(
            f"must be a list of {', '.join(KINDS)}", field=f"{field_name}.on"
        )
    webhook = value.get("webhook")
    if webhook is not None:
        if not isinstance(webhook, str):
            raise errors.ValidationError("must be an http(s) URL", field=f"{field_name}.webhook")
        # a target's rules: no credentials (they would reach logs and the alert's errors)
        from schedctl.core.ssrf import split_url  # here: it loads asyncio
        from schedctl.domain.jobspec import check_url  # here: jobspec imports this module

        check_url(webhook, f"{field_name}.webhook")
        split_url(webhook, f"{field_name}.webhook")  # and a host name that can be sent
    email = value.get("email", [])
    if isinstance(email, str):
        email = [email]
    if not isinstance(email, list) or len(email) > MAX_EMAILS:
        raise errors.ValidationError(
            f"must be a list of at most {MAX_EMAILS} e-mail addresses",
            field=f"{field_name}.email",
        )
    for address in email:
        if not isinstance(address, str) or not EMAIL_ADDRESS.fullmatch(address):
            raise errors.ValidationError(
                f"{limits.describe(address)} is not an e-mail address (user@domain, ASCII, no "
                "spaces, quotes or control characters)",
                field=f"{field_name}.email",
            )
    command = value.get("command", False)
    if not isinstance(command, bool):
        raise errors.ValidationError("must be true or false", field=f"{field_name}.command")
    no_success = value.get("no_success")
    duration = None
    if no_success is not None:
        if not isinstance(no_success, str):
            raise errors.ValidationError(
                "must be a duration like 'PT26H'", field=f"{field_name}.no_success"
            )
        duration = parse_duration(no_success, f"{field_name}.no_success")
        if duration < timedelta(minutes=1):
            raise errors.ValidationError(
                "must be at least one minute", field=f"{field_name}.no_success"
            )
    return AlertConfig(
        on=tuple(dict.fromkeys(on)),
        webhook=webhook,
        email=tuple(email),
        command=command,
        no_success=duration,
    )


def dumps(config: AlertConfig) -> str:
    return json.dumps(config.to_dict(), sort_keys=True)


def loads(text: str) -> AlertConfig:
    """Stored settings, checked as parse_alerts does; but an address stored before the
    address rule tightened is kept as it is (the alert lane refuses to mail it and gives
    its alert up with the reason) instead of failing every settle and check reading it."""
    value = json.loads(text)
    try:
        return parse_alerts(value)
    except errors.ValidationError as exc:
        if exc.field != "alerts.email" or not isinstance(value, dict):
            raise
        emails = value.get("email", [])
        emails = [emails] if isinstance(emails, str) else emails
        rest = parse_alerts({k: v for k, v in value.items() if k != "email"})
        return replace(rest, email=tuple(str(e) for e in emails))


def alert_body(
    *,
    kind: str,
    tenant_id: str,
    job_id: str,
    scheduled_at: datetime,
    attempt: int | None,
    error: str | None,
    at: datetime,
    job_name: str | None = None,
) -> dict[str, Any]:
    """What every channel sends: the run and why; never the job's payload."""
    return {
        "alert": kind,
        "tenant_id": tenant_id,
        "job_id": job_id,
        "job_name": job_name,
        "scheduled_at": scheduled_at.isoformat(),
        "attempt": attempt,
        "error": error,
        "at": at.isoformat(),
    }
