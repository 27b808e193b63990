"""Owns the daemon-log copy of a running command's output: each line of stdout and stderr,
as it arrives, logged at INFO tagged with the job and the run (`job JOB run TIME: line`,
stderr lines marked; with --log-format json, `job`, `run`, `run_key`, `attempt` and
`stream` are fields of the entry).

Bounded, so that a command cannot make the worker's log the bottleneck of the command: a
line longer than MAX_LINE_BYTES is cut (the rest of it until its newline is dropped), and a
run logs at most MAX_LINES_PER_SECOND lines a second; the lines over that are counted and
said once, as "N lines not logged", when the second is over (or the command's output ends).
The run history (`schedctl logs`) keeps the end of the output regardless.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable

from schedctl.domain.leasing import LeasedRun
from schedctl.scheduling.timeparse import format_instant

log = logging.getLogger("scheduled_d.output")

MAX_LINE_BYTES = 4096
MAX_LINES_PER_SECOND = 1000
STREAMS = ("stdout", "stderr")


class RunOutputLog:
    """The log lines of one run's output: `feed(stream, chunk)` as bytes arrive,
    `close()` once the command's output has ended (logs unfinished lines and the count
    of lines not logged)."""

    def __init__(
        self,
        lease: LeasedRun,
        *,
        logger: logging.Logger = log,
        clock: Callable[[], float] = time.monotonic,
        max_line_bytes: int = MAX_LINE_BYTES,
        max_lines_per_second: int = MAX_LINES_PER_SECOND,
    ) -> None:
        self.logger = logger
        self.clock = clock
        self.max_line_bytes = max_line_bytes
        self.max_lines_per_second = max_lines_per_second
        self.lease = lease
        self.job = lease.job_id
        # per stream: the unfinished line, and whether it was cut (its rest is dropped)
        self._partial = {stream: bytearray() for stream in STREAMS}
        self._cut = dict.fromkeys(STREAMS, False)
        self._window_start = clock()
        self._logged = 0  # lines logged in the current one-second window
        self.dropped = 0  # lines over the rate, not said yet
        self.enabled = logger.isEnabledFor(logging.INFO)

    @functools.cached_property
    def run(self) -> str:
        # made when a first line is logged: most commands of a busy worker print nothing
        return format_instant(self.lease.scheduled_at)

    @functools.cached_property
    def fields(self) -> dict[str, object]:
        lease = self.lease
        return {
            "job": lease.job_id,
            "run": self.run,
            "run_key": lease.idempotency_key,
            "attempt": lease.attempt,
        }

    def feed(self, stream: str, chunk: bytes) -> None:
        """Bytes of `stream` (stdout or stderr) as they arrived."""
        if not self.enabled:
            return  # nobody reads them: not even split into lines
        partial = self._partial[stream]
        start = 0
        while True:  # bounded: one pass per newline of the chunk
            end = chunk.find(b"\n", start)
            if end < 0:
                break
            self._add(stream, partial, chunk[start:end])
            self._line(stream, bytes(partial), self._cut[stream])
            partial.clear()
            self._cut[stream] = False
            start = end + 1
        self._add(stream, partial, chunk[start:])

    def close(self) -> None:
        """The output ended: the unfinished lines, then how many lines were not logged."""
        if not self.enabled:
            return
        for stream in STREAMS:
            if self._partial[stream]:
                self._line(stream, bytes(self._partial[stream]), self._cut[stream])
                self._partial[stream].clear()
        self._say_dropped()

    def _add(self, stream: str, partial: bytearray, data: bytes) -> None:
        room = self.max_line_bytes - len(partial)
        if len(data) > room:
            self._cut[stream] = True
            data = data[: max(room, 0)]
        partial += data

    def _line(self, stream: str, data: bytes, cut: bool) -> None:
        now = self.clock()
        if now - self._window_start >= 1.0:
            self._say_dropped()
            self._window_start = now
            self._logged = 0
        if self._logged >= self.max_lines_per_second:
            self.dropped += 1
            return
        self._logged += 1
        text = data.decode("utf-8", errors="replace").rstrip("\r")
        if cut:
            text += f" [cut at {self.max_line_bytes} bytes]"
        marker = " stderr" if stream == "stderr" else ""
        self.logger.info(
            "job %s run %s%s: %s",
            self.job,
            self.run,
            marker,
            text,
            extra={**self.fields, "stream": stream},
        )

    def _say_dropped(self) -> None:
        if self.dropped:
            self.logger.info(
                "job %s run %s: %d lines not logged (over %d lines/s)",
                self.job,
                self.run,
                self.dropped,
                self.max_lines_per_second,
                extra={**self.fields, "lines_not_logged": self.dropped},
            )
            self.dropped = 0
