"""Supervision of the daemon's component threads (dispatcher, relay, workers, maintenance).

Nothing stops silently:

- A component loop that raises an unexpected exception is logged with its traceback and
  started again after a backoff (1 s doubling to 30 s, back to 1 s after a run that lasted
  a minute). `run` is called anew each time, so a caller that passes a factory
  (`lambda: Dispatcher(...).run(stop)`) restarts with fresh in-memory state.
- A component thread that ends anyway (a BaseException such as SystemExit, or a loop that
  returned although nobody asked it to stop) is a death: `healthy()` turns false at once
  (so /healthz answers 503), `died` is set, and the mode's main loop shuts the process
  down in order and exits non-zero (ComponentFailed), so systemd restarts it.

`SCHEDULED_D_FAULTS` injects faults for tests: a comma-separated list of `NAME:raise`
(the component NAME raises RuntimeError once, before its first start) and
`NAME:exit-when:PATH` (NAME's thread ends, as if killed, once PATH exists; its loop does
not run meanwhile).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from schedctl.core import errors

log = logging.getLogger(__name__)

# Errors that no restart fixes: a wrong setting, a rejected token.
_NEEDS_AN_OPERATOR = (errors.ConfigError, errors.Unauthorized)

BACKOFF_MIN_SECONDS = 1.0
BACKOFF_MAX_SECONDS = 30.0
# a run that lasted this long was healthy: the next failure starts the backoff over
HEALTHY_RUN_SECONDS = 60.0
FAULTS_ENV = "SCHEDULED_D_FAULTS"


class ComponentFailed(errors.SchedError):
    """A component thread of the daemon ended unexpectedly; the process exits so that its
    service manager restarts it."""


@dataclass
class _Component:
    name: str
    stop: threading.Event
    thread: threading.Thread | None = None
    restarts: int = 0
    failed: bool = False


@dataclass
class Supervisor:
    components: list[_Component] = field(default_factory=list)
    probes: dict[str, Callable[[], bool]] = field(default_factory=dict)
    died: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(
        self, name: str, run: Callable[[], object], stop: threading.Event
    ) -> threading.Thread:
        """Run `run()` on a daemon thread named `name` until `stop` is set, restarting it
        after unexpected exceptions."""
        component = _Component(name, stop)
        thread = threading.Thread(
            target=self._supervise, args=(component, run), name=name, daemon=True
        )
        component.thread = thread
        with self._lock:
            self.components.append(component)
        thread.start()
        return thread

    def watch(self, name: str, probe: Callable[[], bool]) -> None:
        """A component run elsewhere (the API server's thread): while it is expected to run,
        `probe()` false counts as a death."""
        self.probes[name] = probe

    def unwatch(self, name: str) -> None:
        """The watched component is being stopped on purpose."""
        self.probes.pop(name, None)

    def failures(self) -> list[str]:
        """Components that died (and were not asked to stop)."""
        with self._lock:
            dead = [c.name for c in self.components if c.failed]
        dead += [name for name, probe in self.probes.items() if not probe()]
        return dead

    def healthy(self) -> bool:
        return not self.failures()

    def check(self) -> bool:
        """True when something died; sets `died` for a probe-watched component too."""
        if self.failures():
            self.died.set()
        return self.died.is_set()

    def _supervise(self, component: _Component, run: Callable[[], object]) -> None:
        backoff = BACKOFF_MIN_SECONDS
        try:
            while not component.stop.is_set():
                started = time.monotonic()
                try:
                    _inject_fault(component.name, component.stop, first=component.restarts == 0)
                    run()
                except _NEEDS_AN_OPERATOR as exc:
                    # no traceback: a setting is wrong (e.g. the worker's tenant does not exist
                    # yet); it is tried again, slowly, until an operator fixes it
                    component.restarts += 1
                    log.error(
                        "%s cannot run: %s (retrying in %.0f s)", component.name, exc, backoff
                    )
                    component.stop.wait(backoff)
                    backoff = min(backoff * 2, BACKOFF_MAX_SECONDS)
                    continue
                except Exception:
                    if time.monotonic() - started >= HEALTHY_RUN_SECONDS:
                        backoff = BACKOFF_MIN_SECONDS
                    component.restarts += 1
                    log.exception(
                        "%s failed unexpectedly (restart %d in %.0f s)",
                        component.name,
                        component.restarts,
                        backoff,
                    )
                    component.stop.wait(backoff)
                    backoff = min(backoff * 2, BACKOFF_MAX_SECONDS)
                    continue
                if not component.stop.is_set():
                    log.error("%s returned although it was not asked to stop", component.name)
                    self._fail(component)
                return
        except BaseException:
            log.critical("%s died", component.name, exc_info=True)
            self._fail(component)
            raise

    def _fail(self, component: _Component) -> None:
        with self._lock:
            component.failed = True
        self.died.set()


def run_inline(name: str, run: Callable[[], object], stop: threading.Event) -> None:
    """The supervisor's restart loop on the calling thread (the standalone worker mode):
    returns when `run` returns; unexpected exceptions are logged and `run` starts again
    after a backoff."""
    backoff = BACKOFF_MIN_SECONDS
    restarts = 0
    while True:
        started = time.monotonic()
        try:
            _inject_fault(name, stop, first=restarts == 0)
            run()
            return
        except _NEEDS_AN_OPERATOR:
            raise  # the process exits with the error's code; restarting cannot fix a setting
        except Exception:
            if time.monotonic() - started >= HEALTHY_RUN_SECONDS:
                backoff = BACKOFF_MIN_SECONDS
            restarts += 1
            log.exception("%s failed unexpectedly (restart %d in %.0f s)", name, restarts, backoff)
            if stop.wait(backoff):
                return
            backoff = min(backoff * 2, BACKOFF_MAX_SECONDS)


def _inject_fault(name: str, stop: threading.Event, *, first: bool) -> None:
    spec = os.environ.get(FAULTS_ENV, "")
    for item in filter(None, (part.strip() for part in spec.split(","))):
        target, _, fault = item.partition(":")
        if target != name:
            continue
        kind, _, argument = fault.partition(":")
        if kind == "raise" and first:
            raise RuntimeError(f"fault injected into {name} ({FAULTS_ENV})")
        if kind == "exit-when":
            while not os.path.exists(argument):
                if stop.wait(0.05):
                    return
            raise SystemExit(f"fault injected into {name}: it ends ({FAULTS_ENV})")
