"""Owns HTTP delivery: one signed POST of a run to its tenant's endpoint, through the SSRF
guard, with a timeout per call, and what the answer means.

The request: ``POST`` of ``{"job_id", "scheduled_at", "attempt", "payload"}`` (compact JSON)
with ``Content-Type: application/json`` and the headers of schedctl.signing
(Idempotency-Key, X-Sched-Timestamp, X-Sched-Signature), signed with every secret given
(the tenant's current one, and its previous one during a rotation's grace period).

The answer: 2xx succeeded. 408, 429, 5xx, a timeout or a network error: retry, after at
least the Retry-After the endpoint asked for (seconds or an HTTP date, capped at
MAX_RETRY_AFTER_SECONDS). A redirect is not followed and fails, like every other 4xx: the
same request would get the same answer again. A destination the guard refuses fails
without any connection being made.
"""

from __future__ import annotations

import email.utils
import enum
import json
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import requests

from schedctl import __version__, errors
from schedctl.delivery.ssrf import (
    AllowList,
    PinnedAdapter,
    Resolver,
    UnresolvableHost,
    check_destination,
    hide_addresses,
    pinned_url,
)
from schedctl.scheduling.timeparse import format_instant
from schedctl.signing import signed_headers

DEFAULT_TIMEOUT_SECONDS = 10.0
DEFAULT_CONNECT_TIMEOUT_SECONDS = 5.0
MAX_RETRY_AFTER_SECONDS = 3600.0
# what is kept of a response body for the run history (error answers, mostly)
RESPONSE_SNIPPET_BYTES = 512
# a larger body is not read: the connection is dropped instead of reused
MAX_RESPONSE_BYTES = 64 * 1024
RETRY_STATUSES = frozenset({408, 429})
USER_AGENT = f"scheduled-d/{__version__} (+schedctl)"


class Verdict(enum.StrEnum):
    succeeded = "succeeded"
    retry = "retry"  # try again after a backoff (and at least retry_after)
    failed = "failed"  # permanent: no retry, straight to the dead letters


@dataclass(frozen=True)
class DeliveryResult:
    verdict: Verdict
    status: int | None = None  # the HTTP status, when there was an answer
    error: str | None = None  # why it did not succeed
    detail: str | None = None  # what the endpoint said (for the run history)
    retry_after: float | None = None  # seconds the endpoint asked us to wait
    seconds: float = 0.0  # how long the call took


def delivery_body(job_id: str, scheduled_at: datetime, attempt: int, payload: Any) -> bytes:
    """The exact bytes POSTed (and signed)."""
    document = {
        "job_id": job_id,
        "scheduled_at": format_instant(scheduled_at),
        "attempt": attempt,
        "payload": payload,
    }
    return json.dumps(document, separators=(",", ":"), ensure_ascii=False).encode()


def parse_retry_after(value: str | None, *, now: float | None = None) -> float | None:
    """Seconds to wait from a Retry-After header (delta-seconds or an HTTP date), capped."""
    if not value:
        return None
    text = value.strip()
    # ASCII only: str.isdigit() is also true for "²", which float() refuses
    if text.isascii() and text.isdigit():
        seconds = float(text)
    else:
        try:
            when = email.utils.parsedate_to_datetime(text)
        except (TypeError, ValueError, IndexError):
            return None
        if when is None:
            return None
        seconds = when.timestamp() - (time.time() if now is None else now)
    if not math.isfinite(seconds):
        return None
    return min(max(seconds, 0.0), MAX_RETRY_AFTER_SECONDS)


def classify(status: int) -> Verdict:
    if 200 <= status < 300:
        return Verdict.succeeded
    if status in RETRY_STATUSES or status >= 500:
        return Verdict.retry
    return Verdict.failed


class HttpDelivery:
    """Delivers runs over HTTP; one instance is shared by all delivery threads (the
    connection pools are thread-safe and keep connections to each checked address alive).

    - timeout: seconds to wait for the answer (each read); connect_timeout: for the TCP
      and TLS handshake.
    - resolver: how host names become addresses (tests inject one).
    - ca_bundle: a CA file for endpoints with a private CA (default: the system's).
    """

    def __init__(
        self,
        *,
        timeout: float = DEFAULT_TIMEOUT_SECONDS,
        connect_timeout: float | None = None,
        resolver: Resolver | None = None,
        ca_bundle: str | None = None,
        pool_size: int = 32,
        user_agent: str = USER_AGENT,
    ) -> None:
        if timeout <= 0:
            raise errors.ConfigError("must be positive", field="http_timeout")
        self.timeout = timeout
        self.connect_timeout = min(
            connect_timeout if connect_timeout is not None else DEFAULT_CONNECT_TIMEOUT_SECONDS,
            timeout,
        )
        self.resolver = resolver
        self.verify: bool | str = ca_bundle or True
        self.user_agent = user_agent
        # no retries inside urllib3: every attempt is recorded and paced by the relay
        self._adapter = PinnedAdapter(
            pool_connections=256, pool_maxsize=pool_size, max_retries=0, pool_block=False
        )

    def close(self) -> None:
        self._adapter.close()

    def deliver(
        self,
        *,
        url: str,
        allow_list: AllowList | Iterable[str],
        secret: str | Sequence[str],
        job_id: str,
        scheduled_at: datetime,
        attempt: int,
        payload: Any,
    ) -> DeliveryResult:
        started = time.monotonic()

        def result(verdict: Verdict, **fields: Any) -> DeliveryResult:
            return DeliveryResult(verdict, seconds=time.monotonic() - started, **fields)

        try:
            destination = check_destination(url, allow_list, resolver=self.resolver)
        except errors.ForbiddenDestination as exc:
            return result(Verdict.failed, error=f"refused by the SSRF guard: {exc}")
        except UnresolvableHost as exc:
            return result(Verdict.retry, error=f"network error: {exc}")
        except errors.ValidationError as exc:
            return result(Verdict.failed, error=str(exc))
        body = delivery_body(job_id, scheduled_at, attempt, payload)
        key = f"{job_id}:{format_instant(scheduled_at)}"
        target, host_header = pinned_url(destination, destination.addresses[0])
        headers = {
            "Host": host_header,
            "Content-Type": "application/json",
            "User-Agent": self.user_agent,
            "Accept": "*/*",
        }
        prepared = requests.Request("POST", target, headers=headers, data=body).prepare()
        # v2 signs the request target exactly as it goes on the wire (path and query)
        prepared.headers.update(
            signed_headers(secret, body, key, method="POST", path=prepared.path_url or "/")
        )
        try:
            response = self._adapter.send(
                prepared,
                stream=True,
                timeout=(self.connect_timeout, self.timeout),
                verify=self.verify,
            )
        except requests.Timeout as exc:
            return result(Verdict.retry, error=f"timed out: {_reason(exc)}")
        except requests.RequestException as exc:
            return result(Verdict.retry, error=f"network error: {_reason(exc)}")
        try:
            snippet = _read_snippet(response)
        except requests.RequestException as exc:
            return result(
                Verdict.retry,
                status=response.status_code,
                error=f"HTTP {response.status_code}, then the body failed: {_reason(exc)}",
            )
        finally:
            response.close()
        status = response.status_code
        verdict = classify(status)
        said = f"HTTP {status} {response.reason or ''}".strip()
        detail = f"{said}: {snippet}" if snippet else said
        if verdict is Verdict.succeeded:
            return result(verdict, status=status, detail=detail)
        if 300 <= status < 400:
            location = response.headers.get("Location", "")
            error = f"{said}: redirect to {location[:200]!r} not followed"
        else:
            error = detail
        return result(
            verdict,
            status=status,
            error=error,
            detail=detail,
            retry_after=parse_retry_after(response.headers.get("Retry-After")),
        )


def _read_snippet(response: requests.Response) -> str:
    """A bounded read of the body; fully read bodies let the connection be reused."""
    data = bytearray()
    for chunk in response.iter_content(8192):
        data += chunk
        if len(data) > MAX_RESPONSE_BYTES:
            break  # response.close() then drops the connection instead of reading on
    text = bytes(data[:RESPONSE_SNIPPET_BYTES]).decode("utf-8", errors="replace")
    # one line in the run history, whatever the endpoint sent
    return " ".join("".join(c if c.isprintable() else " " for c in text).split())


def _reason(exc: BaseException) -> str:
    """_cause without the address it was connecting to: the run history is the tenant's,
    and must not tell what a host name resolved to (the SSRF guard's rule)."""
    return hide_addresses(_cause(exc))


def _cause(exc: BaseException) -> str:
    """The innermost readable cause of a requests/urllib3 error, on one line."""
    current: BaseException | None = exc
    text = str(exc)
    seen = 0
    while current is not None and seen < 5:
        reason = getattr(current, "reason", None)
        if isinstance(reason, BaseException):
            current = reason
            text = str(reason)
        elif current.args and isinstance(current.args[0], BaseException):
            current = current.args[0]
            text = str(current)
        else:
            break
        seen += 1
    return " ".join(text.split())[:300] or type(exc).__name__
