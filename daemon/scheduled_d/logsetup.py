"""The daemon's log: text lines or JSON objects on stderr, one per record.

Text under journald (JOURNAL_STREAM names our stderr): no timestamp (the journal adds its
own) and a syslog priority prefix "<N>" on every line, which journald turns into the
entry's priority (so `journalctl -p warning` works), then the level name. Elsewhere:
"TIME LEVEL LOGGER MESSAGE". JSON: {"time", "level", "logger", "thread", "message"} plus
"exception" and any extra fields of the record, one object per line (under journald after
the same priority prefix, which journald removes).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from datetime import UTC, datetime
from typing import TextIO

from schedctl.domain.config import LOG_FORMATS, LOG_LEVELS

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
# syslog priorities of the logging levels (journald reads "<N>" at the start of a line)
_PRIORITY = {
    logging.DEBUG: 7,
    logging.INFO: 6,
    logging.WARNING: 4,
    logging.ERROR: 3,
    logging.CRITICAL: 2,
}
# what every LogRecord has: anything else was passed as extra= and goes into the JSON
_STANDARD = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {
    "message",
    "asctime",
    "taskName",
}


def _priority(levelno: int) -> int:
    for level in sorted(_PRIORITY, reverse=True):
        if levelno >= level:
            return _PRIORITY[level]
    return 7


class JournalFormatter(logging.Formatter):
    """ "<6>INFO scheduled_d.runtime: message", every line of it prefixed (a traceback's
    lines keep the record's priority instead of becoming separate INFO entries)."""

    def format(self, record: logging.LogRecord) -> str:
        text = f"{record.levelname} {record.name}: {record.getMessage()}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        if record.stack_info:
            text += "\n" + self.formatStack(record.stack_info)
        prefix = f"<{_priority(record.levelno)}>"
        return "\n".join(prefix + line for line in text.splitlines() or [""])


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (under journald after a "<N>" priority
    prefix, which journald strips: the journal entry is the JSON text itself)."""

    def __init__(self, *, journal: bool = False) -> None:
        super().__init__()
        self.journal = journal

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, UTC)
            .isoformat(timespec="milliseconds")
            .replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "thread": record.threadName,
            "message": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD and key not in entry:
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        text = json.dumps(entry, ensure_ascii=False, default=str)
        return f"<{_priority(record.levelno)}>{text}" if self.journal else text


def under_journald(stream: TextIO | None = None) -> bool:
    """True when JOURNAL_STREAM ("DEVICE:INODE") is the stream's own file, as
    systemd.exec(5) says to check (a redirected stderr is not the journal)."""
    value = os.environ.get("JOURNAL_STREAM", "")
    device, _, inode = value.partition(":")
    if not (device.isdigit() and inode.isdigit()):
        return False
    try:
        st = os.fstat((stream or sys.stderr).fileno())
    except (OSError, ValueError, AttributeError):
        return False
    return st.st_dev == int(device) and st.st_ino == int(inode)


def make_formatter(log_format: str, stream: TextIO | None = None) -> logging.Formatter:
    if log_format == "json":
        return JsonFormatter(journal=under_journald(stream))
    if under_journald(stream):
        return JournalFormatter()
    return logging.Formatter(TEXT_FORMAT)


def setup(level: str, log_format: str) -> None:
    """Replace the root logger's handlers by one on stderr (level and format already
    checked by the configuration: LOG_LEVELS, LOG_FORMATS)."""
    assert level in LOG_LEVELS and log_format in LOG_FORMATS, (level, log_format)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(make_formatter(log_format, sys.stderr))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)


def set_level(level: str) -> None:
    logging.getLogger().setLevel(level)
