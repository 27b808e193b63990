"""Owns throwaway ZooKeeper servers for tests: a standalone server or a local ensemble.

Each server is a ``java ... QuorumPeerMain zoo.cfg`` process in its own process group with
its own fresh data directory, listening on 127.0.0.1 on free non-default ports, logging to
a file. Ticks are short (500 ms) so sessions can be short too (minimum 1 s). Readiness is
judged from the ``srvr`` four-letter command's ``Mode:`` line, every probe with a short
socket timeout because a status command sent during startup can hang (ZOOKEEPER-5051).
Servers are numbered from 0 (myid is index + 1). Starting, waiting and stopping are
tests.services.process's.

With `tls`, each server also serves a TLS client port (``secure_hosts``) through Netty, with
PEM key and trust stores (ZooKeeper 3.8 reads PEM directly; Debian's libnetty-java, a
dependency of the zookeeper package, has the jars). The plain port stays, for the readiness
probe. Authentication needs nothing on the server: digest auth and ACLs are stock.
"""

from __future__ import annotations

import atexit
import contextlib
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.services.ports import ServiceError, free_ports
from tests.services.process import ServerProcess, Service, poll_ready, run_until_enter

JAVA_DIR = Path("/usr/share/java")
ZOOKEEPER_JAR = JAVA_DIR / "zookeeper.jar"
# zookeeper.jar's manifest Class-Path pulls in jute, netty, slf4j-api, metrics, etc.;
# slf4j-simple is the logging backend (to stderr, which goes to the server's log file).
CLASSPATH = [ZOOKEEPER_JAR, JAVA_DIR / "slf4j-simple.jar"]
# NettyServerCnxnFactory (the TLS port) also needs what netty-handler needs; the manifest
# leaves these two out
NETTY_CLASSPATH = [JAVA_DIR / "netty-codec.jar", JAVA_DIR / "netty-resolver.jar"]
MAIN_CLASS = "org.apache.zookeeper.server.quorum.QuorumPeerMain"
TICK_TIME_MS = 500
MIN_SESSION_TIMEOUT_MS = 1000
MAX_SESSION_TIMEOUT_MS = 60000
_INSTALL_HINT = (
    f"ZooKeeper is not installed ({ZOOKEEPER_JAR} is missing). `make test` (or `make deps`) "
    "installs it with `apt-get install -y zookeeper`."
)
_PROBE_TIMEOUT_S = 1.0
_POLL_INTERVAL_S = 0.1
_STOP_TIMEOUT_S = 10.0


def four_letter_word(port: int, command: str, timeout: float = _PROBE_TIMEOUT_S) -> str | None:
    """Send a four-letter command to 127.0.0.1:``port``; the reply, or None on any failure.

    The whole exchange (connect, send, read to EOF) is bounded by ``timeout``.
    """
    deadline = time.monotonic() + timeout
    chunks: list[bytes] = []
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            sock.sendall(command.encode("ascii"))
            for _ in range(1000):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                sock.settimeout(remaining)
                chunk = sock.recv(65536)
                if not chunk:
                    break
                chunks.append(chunk)
            else:
                return None
    except OSError:
        return None
    return b"".join(chunks).decode("utf-8", errors="replace")


def parse_mode(srvr_reply: str | None) -> str | None:
    """The ``Mode:`` of a ``srvr`` reply (standalone, leader, follower, observer), or None."""
    if not srvr_reply:
        return None
    for line in srvr_reply.splitlines():
        if line.startswith("Mode:"):
            return line.split(":", 1)[1].strip()
    return None


@dataclass(frozen=True)
class ZooKeeperTls:
    """The TLS client port's settings: `keystore` is one PEM file with the server's private
    key (PKCS#8) and certificate chain, `truststore` a PEM of the CA(s) client certificates
    are checked against; `client_auth` is ZooKeeper's ssl.clientAuth (none, want, need)."""

    keystore: Path
    truststore: Path
    client_auth: str = "none"


@dataclass
class _Server:
    index: int
    client_port: int
    peer_port: int
    election_port: int
    directory: Path
    secure_port: int | None = None

    @property
    def myid(self) -> int:
        return self.index + 1

    @property
    def data_dir(self) -> Path:
        return self.directory / "data"

    @property
    def cfg_path(self) -> Path:
        return self.directory / "zoo.cfg"

    @property
    def log_path(self) -> Path:
        return self.directory / "server.log"


class ZooKeeperEnsemble(Service):
    """``size`` ZooKeeper servers on 127.0.0.1: standalone if 1, a quorum ensemble if more."""

    def __init__(
        self, size: int = 1, base_dir: Path | None = None, tls: ZooKeeperTls | None = None
    ) -> None:
        if size < 1:
            raise ValueError("an ensemble needs at least one server")
        if not ZOOKEEPER_JAR.is_file():
            raise ServiceError(_INSTALL_HINT)
        java = shutil.which("java")
        if java is None:
            raise ServiceError("java not found on PATH; `make deps` installs zookeeper and a JRE")
        self.java = java
        self.size = size
        self._owns_base_dir = base_dir is None
        self.base_dir = (
            base_dir if base_dir is not None else Path(tempfile.mkdtemp(prefix="schedctl-zk-"))
        )
        self.tls = tls
        per = 4 if tls is not None else 3
        ports = free_ports(per * size)
        self._servers = [
            _Server(
                index=i,
                client_port=ports[per * i],
                peer_port=ports[per * i + 1],
                election_port=ports[per * i + 2],
                directory=self.base_dir / f"server{i + 1}",
                secure_port=ports[per * i + 3] if tls is not None else None,
            )
            for i in range(size)
        ]
        self._processes = [
            ServerProcess(
                f"zookeeper server {s.index}",
                self._command(s),
                log_path=s.log_path,
                cwd=s.directory,
            )
            for s in self._servers
        ]
        self._configured = False
        self._atexit_registered = False

    def __repr__(self) -> str:
        return f"ZooKeeperEnsemble(size={self.size}, hosts={self.hosts!r})"

    # -- addresses -------------------------------------------------------------------

    @property
    def hosts(self) -> str:
        """The kazoo connection string of every server: ``127.0.0.1:p1,127.0.0.1:p2,...``."""
        return ",".join(self.host(i) for i in range(self.size))

    def host(self, i: int) -> str:
        """``127.0.0.1:port`` of server ``i`` alone."""
        return f"127.0.0.1:{self._server(i).client_port}"

    @property
    def secure_hosts(self) -> str:
        """The connection string of every server's TLS port (only with `tls`)."""
        if self.tls is None:
            raise ServiceError("this ensemble has no TLS port (start it with tls=...)")
        return ",".join(f"127.0.0.1:{s.secure_port}" for s in self._servers)

    @property
    def client_ports(self) -> list[int]:
        return [server.client_port for server in self._servers]

    # -- lifecycle -------------------------------------------------------------------

    def start(self, wait: bool = True, timeout: float = 60.0) -> None:
        """Start every server that is not running; by default wait until all serve."""
        for i in range(self.size):
            self.start_server(i)
        if wait:
            self.wait_ready(timeout)

    def start_server(self, i: int) -> None:
        """Start server ``i`` (no-op if running); does not wait for it to serve."""
        server = self._server(i)
        if self._processes[i].is_running():
            return
        self._write_config()
        if not self._atexit_registered:
            atexit.register(self._at_exit)
            self._atexit_registered = True
        server.directory.mkdir(parents=True, exist_ok=True)
        self._processes[i].start(banner=f"starting server {i} (myid {server.myid})")

    def _command(self, server: _Server) -> list[str]:
        return [
            self.java,
            "-Xms32m",
            "-Xmx256m",
            "-XX:+UseSerialGC",
            "-XX:TieredStopAtLevel=1",
            "-Djava.net.preferIPv4Stack=true",
            "-Dzookeeper.admin.enableServer=false",
            # A restarted node may have a transaction log but no snapshot yet.
            "-Dzookeeper.snapshot.trust.empty=true",
            "-Dorg.slf4j.simpleLogger.showDateTime=true",
            "-Dorg.slf4j.simpleLogger.dateTimeFormat=HH:mm:ss.SSS",
            "-cp",
            ":".join(str(jar) for jar in [*CLASSPATH, *(NETTY_CLASSPATH if self.tls else [])]),
            MAIN_CLASS,
            str(server.cfg_path),
        ]

    def stop_server(self, i: int, timeout: float = _STOP_TIMEOUT_S) -> None:
        """SIGTERM server ``i``'s process group and wait; SIGKILL it if it does not exit."""
        self._process(i).stop(timeout)

    def kill_server(self, i: int) -> None:
        """SIGKILL server ``i``'s process group (a crash) and reap it."""
        self._process(i).kill()

    def restart_server(self, i: int, wait: bool = True, timeout: float = 60.0) -> None:
        """Stop then start server ``i`` on the same data and ports; by default wait for it."""
        self.stop_server(i)
        self.start_server(i)
        if wait:
            self.wait_server_ready(i, timeout)

    def stop(self) -> None:
        """Stop every server."""
        for i in range(self.size):
            self.stop_server(i)

    def cleanup(self) -> None:
        """Stop every server and delete the ensemble's directory."""
        try:
            self.stop()
        finally:
            for i in range(self.size):
                self.kill_server(i)
            shutil.rmtree(self.base_dir, ignore_errors=True)

    def is_running(self, i: int) -> bool:
        """True if server ``i``'s process is alive."""
        return self._process(i).is_running()

    def pid(self, i: int) -> int | None:
        """Server ``i``'s PID while it runs."""
        return self._process(i).pid

    # -- readiness -------------------------------------------------------------------

    def srvr(self, i: int, timeout: float = _PROBE_TIMEOUT_S) -> str | None:
        """Server ``i``'s reply to ``srvr``, or None if it gave none within ``timeout``."""
        return four_letter_word(self._server(i).client_port, "srvr", timeout)

    def mode(self, i: int) -> str | None:
        """Server ``i``'s mode (standalone, leader, follower), or None if not serving."""
        return parse_mode(self.srvr(i))

    def leader(self) -> int | None:
        """The index of the server that reports being leader, if any."""
        for i in range(self.size):
            if self.is_running(i) and self.mode(i) == "leader":
                return i
        return None

    def wait_server_ready(self, i: int, timeout: float = 60.0) -> str:
        """Wait until server ``i`` serves (standalone, or leader/follower); return its mode."""
        wanted = {"standalone"} if self.size == 1 else {"leader", "follower"}
        process = self._process(i)

        def serving(probe_timeout: float) -> str | None:
            mode = parse_mode(self.srvr(i, probe_timeout))
            return mode if mode in wanted else None

        return poll_ready(
            serving,
            what=f"ZooKeeper server {i} ({self.host(i)})",
            timeout=timeout,
            probe_timeout=_PROBE_TIMEOUT_S,
            interval=_POLL_INTERVAL_S,
            check_alive=process.check_alive,
            logs=process.logs,
        )

    def wait_ready(self, timeout: float = 60.0) -> dict[int, str]:
        """Wait until every running server serves and (ensembles) one is leader.

        Returns the mode of each running server by index.
        """
        deadline = time.monotonic() + timeout
        modes: dict[int, str] = {}
        for i in range(self.size):
            if self.is_running(i):
                remaining = max(0.1, deadline - time.monotonic())
                modes[i] = self.wait_server_ready(i, remaining)
        if not modes:
            raise ServiceError("no ZooKeeper server is running")
        if self.size == 1 or "leader" in modes.values():
            return modes

        def with_leader(probe_timeout: float) -> dict[int, str] | None:
            found = {i: parse_mode(self.srvr(i, probe_timeout)) or "none" for i in modes}
            return found if "leader" in found.values() else None

        return poll_ready(
            with_leader,
            what="a leader of the ZooKeeper ensemble",
            timeout=max(0.1, deadline - time.monotonic()),
            probe_timeout=_PROBE_TIMEOUT_S,
            interval=_POLL_INTERVAL_S,
            logs=self.logs,
        )

    def logs(self, lines: int = 40) -> dict[str, str]:
        """Every server's log tail, titled, for failure reports."""
        return {title: text for p in self._processes for title, text in p.logs(lines).items()}

    def log_tail(self, i: int, lines: int = 40) -> str:
        """The last lines of server ``i``'s log."""
        return self._process(i).log_tail(lines)

    # -- internals -------------------------------------------------------------------

    def _server(self, i: int) -> _Server:
        if not 0 <= i < self.size:
            raise IndexError(f"server index {i} out of range 0..{self.size - 1}")
        return self._servers[i]

    def _process(self, i: int) -> ServerProcess:
        self._server(i)  # the index check
        return self._processes[i]

    def _write_config(self) -> None:
        if self._configured:
            return
        quorum = [
            f"server.{s.myid}=127.0.0.1:{s.peer_port}:{s.election_port}" for s in self._servers
        ]
        for server in self._servers:
            server.data_dir.mkdir(parents=True, exist_ok=True)
            lines = [
                f"tickTime={TICK_TIME_MS}",
                "initLimit=10",
                "syncLimit=5",
                f"minSessionTimeout={MIN_SESSION_TIMEOUT_MS}",
                f"maxSessionTimeout={MAX_SESSION_TIMEOUT_MS}",
                f"dataDir={server.data_dir}",
                f"clientPort={server.client_port}",
                "clientPortAddress=127.0.0.1",
                "maxClientCnxns=0",
                "admin.enableServer=false",
                "4lw.commands.whitelist=*",
                "forceSync=no",
            ]
            if self.tls is not None:
                lines += [
                    f"secureClientPort={server.secure_port}",
                    "secureClientPortAddress=127.0.0.1",
                    "serverCnxnFactory=org.apache.zookeeper.server.NettyServerCnxnFactory",
                    f"ssl.keyStore.location={self.tls.keystore}",
                    "ssl.keyStore.type=PEM",
                    f"ssl.trustStore.location={self.tls.truststore}",
                    "ssl.trustStore.type=PEM",
                    f"ssl.clientAuth={self.tls.client_auth}",
                ]
            if self.size > 1:
                lines += ["cnxTimeout=1000", *quorum]
                (server.data_dir / "myid").write_text(f"{server.myid}\n")
            server.cfg_path.write_text("\n".join(lines) + "\n")
        self._configured = True

    def _at_exit(self) -> None:
        """Last resort at interpreter exit: never leave a server running."""
        with contextlib.suppress(Exception):
            for i in range(self.size):
                self.kill_server(i)
            if self._owns_base_dir:
                shutil.rmtree(self.base_dir, ignore_errors=True)


def _main(argv: Sequence[str]) -> int:
    """``python -m tests.services.zookeeper [SIZE]``: run servers until Enter is pressed."""
    ensemble = ZooKeeperEnsemble(int(argv[0]) if argv else 1)
    return run_until_enter(
        ensemble, lambda: f"zookeeper running: {ensemble.hosts}  (dir {ensemble.base_dir})"
    )


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
