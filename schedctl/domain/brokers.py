"""Owns the form of a tenant's RabbitMQ broker URL: the check `tenant broker` makes before
storing one, and the redaction that keeps its password out of logs, errors and views."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

import pika  # type: ignore[import-untyped]

from schedctl.core import errors


def redact_url(url: str) -> str:
    """The broker URL without its password (for logs, errors and `tenant show`)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<invalid URL>"
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[-1]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))


def check_broker_url(url: str) -> str:
    """A usable amqp:// or amqps:// URL, or ValidationError naming broker_url."""
    text = url.strip()
    try:
        parts = urlsplit(text)
        parts.port  # noqa: B018 -- raises for a port that is not a number
    except ValueError as exc:
        raise errors.ValidationError(f"not a URL: {exc}", field="broker_url") from exc
    if parts.scheme not in ("amqp", "amqps") or not parts.hostname:
        raise errors.ValidationError(
            "must be amqp://[user:password@]host[:port][/vhost] (or amqps://)",
            field="broker_url",
        )
    if "@" in parts.path or "@" in parts.query or "@" in parts.fragment:
        # a password holding "/", "?" or "#" unescaped: the URL then parses with no password
        # and the rest of it (the password's end) would be shown as it is
        raise errors.ValidationError(
            "has an '@' after the host: percent-encode '/', '?', '#' and '@' in the user "
            "name and password (%2F, %3F, %23, %40)",
            field="broker_url",
        )
    try:
        pika.URLParameters(text)
    except (ValueError, TypeError) as exc:
        raise errors.ValidationError(f"not a usable AMQP URL: {exc}", field="broker_url") from exc
    return text
