"""Owns the operator's alert policy (the [alerts] table): the recipient domains e-mail alerts
may go to and the alerts a tenant may have sent per hour. Checked when a tenant sets its
alerts (a clear error naming the field, nothing stored) and again when each alert is sent
(an alert the policy refuses is given up with the reason, never silently dropped).

Why a domain list: e-mail alerts go through the operator's SMTP server with text a tenant
chose (a job name, an error), so without a list any tenant could mail anyone from the
operator's server. The default is safe: where an SMTP server is configured (smtp_host) and
no list is, e-mail alerts are refused; `email_domains = ["*"]` allows every domain on
purpose. Without an SMTP server no mail can leave, so nothing is refused for it here (the
alert lane gives such alerts up, "no SMTP server configured")."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from schedctl.core import errors, limits

DEFAULT_MAX_PER_TENANT_PER_HOUR = 60  # webhook and e-mail alerts sent, per tenant
MAX_PER_TENANT_PER_HOUR = 1_000_000
MAX_DOMAINS = 1000
ANY_DOMAIN = "*"
KEYS = ("email_domains", "max_per_tenant_per_hour")
# a domain as DNS spells it (ASCII, IDNA A-labels); "*.example.com": its subdomains
_DOMAIN = re.compile(
    r"(?:\*\.)?[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
    r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*",
    re.ASCII,
)


@dataclass(frozen=True)
class AlertPolicy:
    """email_domains: None when the operator listed none; smtp_configured: whether this
    scheduler has an SMTP server (then an unset list allows no recipient)."""

    email_domains: tuple[str, ...] | None = None
    max_per_tenant_per_hour: int = DEFAULT_MAX_PER_TENANT_PER_HOUR
    smtp_configured: bool = False

    def refused_recipients(self, addresses: Iterable[str]) -> str | None:
        """Why these recipients may not be mailed (the first refused one), None when all
        may be."""
        if self.email_domains is None:
            if not self.smtp_configured:
                return None
            return (
                "e-mail alerts are not enabled on this scheduler: the operator lists the "
                "recipient domains allowed in [alerts] email_domains"
            )
        if ANY_DOMAIN in self.email_domains:
            return None
        for address in addresses:
            domain = address.rpartition("@")[2].lower().rstrip(".")
            if not any(_matches(domain, allowed) for allowed in self.email_domains):
                allowed_text = ", ".join(self.email_domains) or "none"
                return (
                    f"{limits.describe(address)}: the recipient domain is not one the operator "
                    f"allows ([alerts] email_domains: {allowed_text})"
                )
        return None

    def check(self, emails: Iterable[str], field: str = "alerts.email") -> None:
        """ValidationError naming `field` when an address is not allowed."""
        refused = self.refused_recipients(emails)
        if refused is not None:
            raise errors.ValidationError(refused, field=field)


def _matches(domain: str, allowed: str) -> bool:
    allowed = allowed.lower()
    if allowed.startswith("*."):
        return domain.endswith(allowed[1:])
    return domain == allowed


def parse_policy(raw: Any, refuse: Any) -> AlertPolicy:
    """The [alerts] table; `refuse(key, problem)` makes the ConfigError (naming the line)."""
    if not isinstance(raw, dict):
        raise refuse(None, "must be an [alerts] table")
    for key in raw:
        if key not in KEYS:
            raise refuse(key, f"unknown key (known: {', '.join(KEYS)})")
    values: dict[str, Any] = {}
    if "email_domains" in raw:
        domains = raw["email_domains"]
        if (
            not isinstance(domains, list)
            or len(domains) > MAX_DOMAINS
            or not all(
                isinstance(d, str) and (d == ANY_DOMAIN or _DOMAIN.fullmatch(d)) for d in domains
            )
        ):
            raise refuse(
                "email_domains",
                'must be a list of domains ("example.com", "*.example.com" for its '
                f'subdomains, "*" for any), got {limits.describe(domains)}',
            )
        values["email_domains"] = tuple(dict.fromkeys(d.lower() for d in domains))
    if "max_per_tenant_per_hour" in raw:
        value = raw["max_per_tenant_per_hour"]
        if not limits.is_int(value) or not 1 <= value <= MAX_PER_TENANT_PER_HOUR:
            raise refuse(
                "max_per_tenant_per_hour",
                f"must be an integer from 1 to {MAX_PER_TENANT_PER_HOUR}, "
                f"got {limits.describe(value)}",
            )
        values["max_per_tenant_per_hour"] = value
    return AlertPolicy(**values)
