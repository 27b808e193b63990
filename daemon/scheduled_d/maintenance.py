"""Periodic housekeeping run by dispatchers: history older than the retention period
removed (runs; dead letters, sent alerts and audit entries by their own ages), and day
partitions of the run history made ahead where the daemon's role owns the table. Run as
the runtime role (no DDL), it only deletes expired rows and warns when the owner's
partitions (`schedctl db maintain` on a timer) run short."""

from __future__ import annotations

import logging
import threading

from schedctl.core import errors
from schedctl.domain.config import Config
from schedctl.storage.db.store import Store
from schedctl.storage.records.retention import MIN_DAYS_AHEAD, RecordRetention, maintain_runs

log = logging.getLogger(__name__)

INTERVAL_SECONDS = 3600.0


def record_retention(config: Config) -> RecordRetention:
    """The configured ages of dead letters, alerts and audit entries."""
    return RecordRetention(
        dead_letter_days=config.dead_letter_retention_days,
        alert_days=config.alert_retention_days,
        audit_days=config.audit_retention_days,
    )


def maintain_once(
    store: Store, retention_days: int, records: RecordRetention | None = None
) -> None:
    """One pass, its outcome logged; a database error propagates."""
    done = maintain_runs(store, retention_days=retention_days, records=records)
    if done.created or done.removed or done.pruned.total:
        log.info(
            "maintenance: %d day partitions created, %d expired removed; %d dead letters, "
            "%d alerts, %d audit entries past their retention deleted",
            len(done.created),
            done.removed,
            done.pruned.dead_letters,
            done.pruned.alerts,
            done.pruned.audit_log,
        )
    if done.running_short:
        # no run is lost: a day without its partition fills the default one, which only
        # retention (a whole-day DROP) and the day's plans lose by
        log.warning(
            "run history has day partitions for %d day(s) ahead (fewer than %d): run "
            "`schedctl db maintain` as the database owner (scheduled-d-maintain.timer); "
            "%s",
            done.days_ahead,
            MIN_DAYS_AHEAD,
            "meanwhile new runs go to the default partition"
            if not done.owned
            else "this role could not create them",
        )


def run_maintenance(
    store: Store,
    retention_days: int,
    stop: threading.Event,
    records: RecordRetention | None = None,
) -> None:
    """Once at start and then hourly; several dispatchers doing it is harmless."""
    while not stop.is_set():
        try:
            maintain_once(store, retention_days, records)
        except errors.SchedError as exc:
            log.warning("maintenance failed, will retry: %s", exc)
        stop.wait(INTERVAL_SECONDS)
