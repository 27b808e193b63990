"""Owns the relay's alert lane: a thread of its own (so alerts never hold up deliveries)
that runs the no-success check now and then and sends due webhook and e-mail alerts, each
leased, sent and settled at least once."""

from __future__ import annotations

import logging
import threading
import time
from datetime import datetime

from schedctl import errors
from schedctl.alerts.model import EMAIL, WEBHOOK
from schedctl.delivery import email
from schedctl.delivery.http import HttpDelivery
from schedctl.models import Verdict
from schedctl.storage import alerts as repo
from schedctl.storage.signing_secrets import SigningKeyCache
from schedctl.storage.store import Store
from schedctl.storage.tenant_delivery import TenantDeliveryRepo

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
        poll_seconds: float = 1.0,
        check_seconds: float = 60.0,
    ) -> None:
        self.store = store
        self.http = http
        self.signing = signing
        self.smtp = smtp
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
            repo.check_no_success(self.store)
        leased = repo.claim(
            self.store, (WEBHOOK, EMAIL), self.owner, limit=BATCH, lease_seconds=LEASE_SECONDS
        )
        for alert in leased:
            if self._stop.is_set():
                break  # the rest wait for their lease to run out, then go again
            error = self._send(alert)
            if error is None:
                self.sent += 1
            else:
                self.failed += 1
                log.info(
                    "alerts: %s alert of job %s failed (attempt %d): %s",
                    alert.channel,
                    alert.job_id,
                    alert.attempt,
                    error,
                )
            repo.finish(self.store, self.owner, alert, error)
        return len(leased)

    def _send(self, alert: repo.AlertRow) -> str | None:
        if alert.channel == EMAIL:
            return email.send(self.smtp, alert.destination.split(","), alert.body)
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


def _at(alert: repo.AlertRow) -> datetime:
    return datetime.fromisoformat(str(alert.body["scheduled_at"]))
