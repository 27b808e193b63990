"""Periodic housekeeping run by dispatchers: day partitions of the run history made
ahead, and history older than the retention period dropped."""

from __future__ import annotations

import logging
import threading

from schedctl import errors
from schedctl.storage.retention import drop_expired_runs, ensure_run_partitions
from schedctl.storage.store import Store

log = logging.getLogger(__name__)

INTERVAL_SECONDS = 3600.0


def run_maintenance(store: Store, retention_days: int, stop: threading.Event) -> None:
    """Once at start and then hourly; several dispatchers doing it is harmless."""
    while not stop.is_set():
        try:
            created = ensure_run_partitions(store)
            removed = drop_expired_runs(store, retention_days=retention_days)
            if created or removed:
                log.info(
                    "maintenance: %d day partitions created, %d expired removed",
                    len(created),
                    removed,
                )
        except errors.SchedError as exc:
            log.warning("maintenance failed, will retry: %s", exc)
        stop.wait(INTERVAL_SECONDS)
