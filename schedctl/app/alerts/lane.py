"""Owns the relay's alert lane: a thread of its own (so alerts never hold up deliveries)
that runs the no-success check now and then and sends due webhook and e-mail alerts, each
leased, sent and settled at least once.

Each alert is sent, retried and given up on its own: anything escaping one send is a
failed attempt of that alert with its reason (never a pass that fails the whole batch), an
alert that can never be sent (the operator's policy refuses it, a recipient is not a plain
address, the tenant is over its hourly limit) is given up at once with the reason, and the
others after MAX_ALERT_ATTEMPTS."""

from __future__ import annotations

import logging
import threading
import time
from datetime import datetime

from schedctl.core import errors
from schedctl.delivery import email
from schedctl.delivery.http import HttpDelivery
from schedctl.domain.alerts.model import EMAIL, WEBHOOK
from schedctl.domain.alerts.policy import AlertPolicy
from schedctl.domain.models import Verdict
from schedctl.storage.db.store import Store
from schedctl.storage.records import alerts as repo
from schedctl.storage.tenants.signing_secrets import SigningKeyCache
from schedctl.storage.tenants.tenant_delivery import TenantDeliveryRepo

log = logging.getLogger("schedctl.alerts")

BATCH = 20  # alerts leased per pass
LEASE_SECONDS = 60.0  # longer than one HTTP call or SMTP session takes


class AlertLane:
    """Sends alerts until stopped. `poll_seconds`: the pause between passes that found
    nothing; `check_seconds`: how often the no-success check runs."""

    def __init__(
        self,
        store: Store,
        *,
        http: HttpDelivery,
        signing: SigningKeyCache,
        smtp: email.SmtpSettings,
        owner: str,
        policy: AlertPolicy | None = None,
        poll_seconds: float = 1.0,
        check_seconds: float = 60.0,
    ) -> None:
        self.store = store
        self.http = http
        self.signing = signing
        self.smtp = smtp
        self.policy = policy or AlertPolicy(smtp_configured=bool(smtp.host))
        self.owner = f"{owner}:alerts"
        self.poll_seconds = poll_seconds
        self.check_seconds = check_seconds
        self.sent = 0
        self.failed = 0
        self._tenants = TenantDeliveryRepo(store)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._next_check = 0.0

    def start(self) -> None:
        if self.policy.smtp_configured and self.policy.email_domains is None:
            log.warning(
                "alerts: an SMTP server is configured but no recipient domains: every e-mail "
                "alert is given up until [alerts] email_domains lists them"
            )
        self._thread = threading.Thread(target=self._run, name="alerts", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                busy = self.run_once()
            except errors.StoreUnavailable as exc:
                log.warning("alerts: database unavailable: %s", exc)
                busy = 0
            except Exception:  # the lane must outlive a bug in one alert's sending
                log.exception("alerts: pass failed")
                busy = 0
            if busy < BATCH:
                self._stop.wait(self.poll_seconds)

    def run_once(self) -> int:
        """One pass: the no-success check when due, then one batch of due alerts sent."""
        if time.monotonic() >= self._next_check:
            self._next_check = time.monotonic() + self.check_seconds
            try:
                repo.check_no_success(self.store)
            except errors.StoreUnavailable:
                raise
            except Exception:  # a bug in the check must not stop every alert's sending
                log.exception("alerts: the no-success check failed")
        leased = repo.claim(
            self.store, (WEBHOOK, EMAIL), self.owner, limit=BATCH, lease_seconds=LEASE_SECONDS
        )
        sent = repo.sent_last_hour(self.store, {alert.tenant_id for alert in leased})
        for alert in leased:
            if self._stop.is_set():
                break  # the rest wait for their lease to run out, then go again
            error, give_up = self._attempt(alert, sent)
            if error is None:
                self.sent += 1
                sent[alert.tenant_id] = sent.get(alert.tenant_id, 0) + 1
            else:
                self.failed += 1
                log.info(
                    "alerts: %s alert of job %s of tenant %s failed (attempt %d): %s",
                    alert.channel,
                    repo.named(_field(alert, "job_name"), alert.job_id),
                    repo.named(_field(alert, "tenant_name"), alert.tenant_id),
                    alert.attempt,
                    error,
                )
            repo.finish(self.store, self.owner, alert, error, give_up=give_up)
        return len(leased)

    def _attempt(self, alert: repo.AlertRow, sent: dict[str, int]) -> tuple[str | None, bool]:
        """Send one alert: (None, _) when sent, else (why, whether to give it up now)."""
        limit = self.policy.max_per_tenant_per_hour
        if sent.get(alert.tenant_id, 0) >= limit:
            return (
                f"rate limited: the tenant had {limit} alerts sent in the last hour "
                "([alerts] max_per_tenant_per_hour)",
                True,
            )
        try:
            return self._send(alert), False
        except email.Undeliverable as exc:
            return str(exc), True
        except errors.StoreUnavailable:
            raise  # the lane waits the outage out; the lease runs out, the alert goes again
        except Exception as exc:  # this alert's attempt failed, not the batch's
            log.exception("alerts: sending the %s alert %d failed", alert.channel, alert.id)
            return f"{type(exc).__name__}: {exc}", False

    def _send(self, alert: repo.AlertRow) -> str | None:
        if alert.channel == EMAIL:
            recipients = alert.destination.split(",")
            refused = self.policy.refused_recipients(recipients)
            if refused is not None:
                raise email.Undeliverable(refused)
            return email.send(self.smtp, recipients, alert.body)
        try:
            secrets = self.signing.secrets_for(alert.tenant_id)
            allow_list = self._tenants.settings(alert.tenant_id).allow_list
        except errors.SchedError as exc:
            return str(exc)
        # signed and guarded exactly like a run's callback; the alert is the payload
        result = self.http.deliver(
            url=alert.destination,
            allow_list=allow_list,
            secret=secrets,
            job_id=alert.job_id,
            scheduled_at=_at(alert),
            attempt=alert.attempt,
            payload=alert.body,
        )
        return None if result.verdict is Verdict.succeeded else (result.error or "failed")


def _field(alert: repo.AlertRow, key: str) -> str | None:
    """A text field of the alert's body (a body that is not an object has none)."""
    value = alert.body.get(key) if isinstance(alert.body, dict) else None
    return value if isinstance(value, str) else None


def _at(alert: repo.AlertRow) -> datetime:
    return datetime.fromisoformat(str(alert.body["scheduled_at"]))
