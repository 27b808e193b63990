"""Owns the host worker's record of the @reboot jobs run in the current boot: the kernel's
boot id ([host] boot_id_file) and STATE_DIR/boot-runs.json, so that a worker restarted in
the same boot (an upgrade, `systemctl restart`) does not run its boot jobs again.

A job counts as run in this boot once it is *started* (recorded before its command
starts): a worker killed while a boot job runs does not start it again, as cron would
not. The record is per job name: a job whose file changes after the boot runs at the
next boot. The file is written whole to a temporary file (0600) and renamed over the
old one, so a crash leaves the old record or the new one, never half of one. Where no
boot id can be read (no /proc), or the record cannot be written, the jobs run once per
start of the worker, as before, and the log says why.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
import threading
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

FILE_NAME = "boot-runs.json"
MAX_STATE_BYTES = 4 * 1024 * 1024  # far beyond any directory's boot jobs
_BOOT_ID = re.compile(r"[0-9A-Za-z-]{1,64}")


def read_boot_id(path: str | Path) -> str | None:
    """The kernel's boot id (a fresh one at each boot), None where it cannot be read."""
    try:
        with open(path, encoding="ascii") as handle:
            text = handle.read(128).strip()
    except (OSError, UnicodeDecodeError) as exc:
        log.warning("no boot id at %s (%s): @reboot jobs run once per worker start", path, exc)
        return None
    return text if _BOOT_ID.fullmatch(text) else None


class BootRuns:
    """The boot jobs started in boot `boot_id`, kept in `state_dir`/boot-runs.json."""

    def __init__(self, state_dir: str | Path, boot_id: str | None) -> None:
        self.path = Path(state_dir) / FILE_NAME
        self.boot_id = boot_id
        self._lock = threading.Lock()
        self._started: dict[str, str] = self._load() if boot_id is not None else {}

    def _load(self) -> dict[str, str]:
        """This boot's record; another boot's (or none, or an unreadable one) is empty."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return {}
        except OSError as exc:
            log.warning("cannot read %s: %s (boot jobs run as in a new boot)", self.path, exc)
            return {}
        with os.fdopen(fd, "rb") as handle:
            raw = handle.read(MAX_STATE_BYTES + 1)
        try:
            data = json.loads(raw) if len(raw) <= MAX_STATE_BYTES else None
        except ValueError:
            data = None
        if not isinstance(data, dict) or not isinstance(data.get("jobs"), dict):
            log.warning("%s is not a boot-run record: ignored", self.path)
            return {}
        if data.get("boot_id") != self.boot_id:
            return {}  # a record of an earlier boot
        return {str(k): str(v) for k, v in data["jobs"].items()}

    def claim(self, name: str, now: datetime | None = None) -> bool:
        """True once per boot for the job `name` (recorded before it starts); False when it
        already started in this boot. Without a boot id: True (once per process, which the
        worker's own flag ensures)."""
        if self.boot_id is None:
            return True
        with self._lock:
            if name in self._started:
                return False
            self._started[name] = (now or datetime.now(UTC)).isoformat()
            self._write()
            return True

    def _write(self) -> None:
        data: dict[str, Any] = {"boot_id": self.boot_id, "jobs": self._started}
        try:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd, temp = tempfile.mkstemp(prefix=".boot-runs.", dir=self.path.parent)
        except OSError as exc:
            log.error("cannot record boot runs in %s: %s (a restart runs them again)",
                      self.path, exc)  # fmt: skip
            return
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                os.fchmod(handle.fileno(), 0o600)
                json.dump(data, handle, sort_keys=True)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temp, self.path)
        except OSError as exc:
            log.error("cannot record boot runs in %s: %s (a restart runs them again)",
                      self.path, exc)  # fmt: skip
            try:
                os.unlink(temp)
            except OSError:
                pass
