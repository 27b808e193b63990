"""Owns one throwaway RabbitMQ broker for tests: its own epmd, node name, ports, data and
log directory, started from nothing and stopped by PID.

Debian's rabbitmq-server package (3.10) is used without its service: the node runs from
``/usr/lib/rabbitmq/bin/rabbitmq-server`` with ``RABBITMQ_*`` variables pointing at a fresh
directory under /var/tmp, listens on 127.0.0.1 on a free non-default port, and talks to a
private epmd on another free port (``-start_epmd false``), so nothing is shared with, or
left behind for, a system broker. The default ``guest`` user works from loopback.
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import os
import shutil
import uuid
from pathlib import Path

from tests.services.ports import ServiceError, free_port, tail
from tests.services.process import ServerProcess, Service, poll_ready, serve_until_enter

_START_TIMEOUT_S = 90
_STOP_TIMEOUT_S = 30
_PROBE_TIMEOUT_S = 2.0
_INSTALL_HINT = (
    "RabbitMQ not found (looked for /usr/lib/rabbitmq/bin/rabbitmq-server). `make deps` "
    "installs it with `apt-get install -y rabbitmq-server`."
)


def find_server() -> Path:
    versioned = glob.glob("/usr/lib/rabbitmq/lib/rabbitmq_server-*/sbin/rabbitmq-server")
    candidates = [Path("/usr/lib/rabbitmq/bin/rabbitmq-server"), *map(Path, sorted(versioned))]
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    raise ServiceError(_INSTALL_HINT)


class RabbitMQServer(Service):
    """One RabbitMQ node on 127.0.0.1; ``start()`` returns once it accepts AMQP connections.

    ``stop()`` (SIGTERM, then SIGKILL) and ``kill()`` keep the data directory, so a restarted
    broker still has its durable queues and persistent messages. ``cleanup()`` also deletes
    the directory.
    """

    def __init__(self, base_dir: Path | None = None) -> None:
        self.server = find_server()
        self.epmd = shutil.which("epmd") or "/usr/bin/epmd"
        self.base_dir = base_dir or Path("/var/tmp") / f"schedctl-rmq-{uuid.uuid4().hex[:12]}"
        self.port = free_port()
        self.dist_port = free_port()
        self.epmd_port = free_port()
        self.node = f"schedtest{uuid.uuid4().hex[:8]}@localhost"
        self.log_path = self.base_dir / "rabbit.log"
        self.stdout_path = self.base_dir / "stdout.log"
        self._process = ServerProcess(
            "rabbitmq-server", [str(self.server)], log_path=self.stdout_path, env=self._env()
        )
        self._epmd = ServerProcess(
            "epmd",
            [self.epmd, "-port", str(self.epmd_port), "-address", "127.0.0.1"],
            log_path=self.base_dir / "epmd.log",
            env=self._env(),
        )
        self._atexit = False

    def __repr__(self) -> str:
        return f"RabbitMQServer(port={self.port}, base_dir={str(self.base_dir)!r})"

    # -- use ---------------------------------------------------------------------------

    def url(self, vhost: str = "%2F") -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}/{vhost}"

    def log_tail(self, lines: int = 40) -> str:
        return "\n\n".join(f"--- {title} ---\n{text}" for title, text in self.logs(lines).items())

    def logs(self, lines: int = 40) -> dict[str, str]:
        """The broker's log and its stdout, tails titled, for failure reports."""
        return {f"rabbitmq log ({self.log_path})": tail(self.log_path, lines)} | (
            self._process.logs(lines)
        )

    # -- lifecycle -----------------------------------------------------------------------

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RABBITMQ_", "ERL_"))}
        env.update(
            HOME=str(self.base_dir),  # the Erlang cookie lives here
            ERL_EPMD_PORT=str(self.epmd_port),
            ERL_EPMD_ADDRESS="127.0.0.1",
            RABBITMQ_NODENAME=self.node,
            RABBITMQ_NODE_IP_ADDRESS="127.0.0.1",
            RABBITMQ_NODE_PORT=str(self.port),
            RABBITMQ_DIST_PORT=str(self.dist_port),
            RABBITMQ_MNESIA_BASE=str(self.base_dir / "mnesia"),
            RABBITMQ_LOG_BASE=str(self.base_dir / "log"),
            RABBITMQ_LOGS=str(self.log_path),
            RABBITMQ_CONF_ENV_FILE=str(self.base_dir / "rabbitmq-env.conf"),
            RABBITMQ_CONFIG_FILE=str(self.base_dir / "rabbitmq"),
            RABBITMQ_ENABLED_PLUGINS_FILE=str(self.base_dir / "enabled_plugins"),
            RABBITMQ_PID_FILE=str(self.base_dir / "rabbit.pid"),
            RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="-start_epmd false",
            LC_ALL="C.UTF-8",
            LANG="C.UTF-8",
        )
        return env

    def _prepare(self) -> None:
        self.base_dir.mkdir(parents=True, exist_ok=True)
        (self.base_dir / "rabbitmq-env.conf").write_text("")
        (self.base_dir / "enabled_plugins").write_text("[].\n")
        (self.base_dir / "rabbitmq.conf").write_text(
            f"listeners.tcp.1 = 127.0.0.1:{self.port}\n"
            # small test machines: never block publishers on a disk alarm
            "disk_free_limit.absolute = 10MB\n"
            "log.file.level = info\n"
        )

    def is_running(self) -> bool:
        return self._process.is_running()

    def start(self) -> None:
        if self.is_running():
            return
        self._prepare()
        if not self._atexit:
            atexit.register(self._at_exit)
            self._atexit = True
        self._epmd.start()
        self._process.start()
        try:
            self._wait_ready()
        except ServiceError:
            self.kill()
            raise

    def _wait_ready(self) -> None:
        import pika  # type: ignore[import-untyped]
        import pika.exceptions  # type: ignore[import-untyped]

        def accepts(probe_timeout: float) -> bool | None:
            parameters = pika.URLParameters(self.url())
            parameters.connection_attempts = 1
            parameters.socket_timeout = probe_timeout
            parameters.stack_timeout = probe_timeout * 2
            try:
                connection = pika.BlockingConnection(parameters)
            except pika.exceptions.AMQPError:
                return None
            connection.close()
            return True

        poll_ready(
            accepts,
            what="rabbitmq-server (accepting AMQP connections)",
            timeout=_START_TIMEOUT_S,
            probe_timeout=_PROBE_TIMEOUT_S,
            interval=0.25,
            check_alive=self._process.check_alive,
            logs=self.logs,
        )

    def stop(self) -> None:
        """SIGTERM (a clean broker stop), SIGKILL after a grace period; epmd too."""
        self._process.stop(_STOP_TIMEOUT_S, whole_tree=True)
        self._epmd.stop(10)

    def kill(self) -> None:
        """SIGKILL the node and its helpers (a crash)."""
        self._process.kill(whole_tree=True)
        self._epmd.stop(10)

    def cleanup(self) -> None:
        try:
            self.stop()
        finally:
            shutil.rmtree(self.base_dir, ignore_errors=True)

    def _at_exit(self) -> None:
        with contextlib.suppress(Exception):
            self.kill()
            shutil.rmtree(self.base_dir, ignore_errors=True)


if __name__ == "__main__":
    # ``python -m tests.services.rabbitmq``: run a throwaway broker until Enter is pressed
    raise SystemExit(serve_until_enter("rabbitmq", RabbitMQServer()))
