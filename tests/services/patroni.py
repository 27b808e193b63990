"""Owns a throwaway 2-node Patroni cluster for tests: two Patroni processes (Debian's
/usr/bin/patroni, run as the ``postgres`` user), each with its own data directory, REST port
and Postgres port on 127.0.0.1, with a ZooKeeper of tests/services/zookeeper.py as the
DCS, synchronous replication (``synchronous_mode: true``) and ``primary_start_timeout: 0``
(a kill -9'd primary is failed over, not restarted in place). The faults the tests make:
kill -9 of the primary's postmaster, and a planned switchover through the REST API.

Every wait is bounded; ``cleanup()`` stops both Patroni processes, then kills by PID every
process left of them (Patroni and the postmasters, whose PIDs are read from their
postmaster.pid files), and deletes the directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import signal
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

from tests.services.ports import ServiceError, free_port, pid_alive, tail
from tests.services.postgres import SERVER_USER, find_bindir
from tests.services.process import ServerProcess, Service, descendants, kill_and_reap

PATRONI = "/usr/bin/patroni"
_INSTALL_HINT = (
    f"{PATRONI} not found: `make deps` installs it (apt-get install -y patroni python3-kazoo)"
)
_STOP_SECONDS = 30.0
_HTTP_TIMEOUT_SECONDS = 2.0
_POLL_SECONDS = 0.1


@dataclass
class PatroniNode:
    name: str
    pg_port: int
    rest_port: int
    dir: Path
    process: ServerProcess

    @property
    def data_dir(self) -> Path:
        return self.dir / "data"

    @property
    def rest(self) -> str:
        return f"http://127.0.0.1:{self.rest_port}"

    def postmaster_pid(self) -> int | None:
        """The postmaster's PID from its postmaster.pid, if it is there and alive."""
        try:
            first = (self.data_dir / "postmaster.pid").read_text().splitlines()[0]
        except (OSError, IndexError):
            return None
        pid = int(first) if first.strip().isdigit() else 0
        return pid if pid > 0 and pid_alive(pid) else None


def available() -> bool:
    """Whether Patroni (and kazoo for the python3 that runs it) is installed."""
    return Path(PATRONI).is_file() and Path("/usr/lib/python3/dist-packages/kazoo").is_dir()


class PatroniCluster(Service):
    """Two Patroni-managed Postgres servers on loopback sharing `zookeeper` (host:port,...)."""

    def __init__(self, zookeeper: str, *, size: int = 2, base_dir: Path | None = None) -> None:
        if not Path(PATRONI).is_file():
            raise ServiceError(_INSTALL_HINT)
        self.id = uuid.uuid4().hex[:10]
        self.scope = f"schedctl-{self.id}"
        self.zookeeper = zookeeper
        self.base_dir = base_dir or Path("/var/tmp") / f"schedctl-patroni-{self.id}"
        self.bindir = find_bindir()
        self._as_server_user = os.geteuid() == 0
        self.nodes: list[PatroniNode] = []
        for i in range(size):
            node_dir = self.base_dir / f"pg{i}"
            argv = [PATRONI, str(node_dir / "patroni.yml")]
            if self._as_server_user:
                # setpriv execs (runuser would stay the parent): the PID is Patroni's own
                argv = ["setpriv", "--reuid", SERVER_USER, "--regid", SERVER_USER,
                        "--init-groups", *argv]  # fmt: skip
            self.nodes.append(
                PatroniNode(
                    name=f"pg{i}",
                    pg_port=free_port(),
                    rest_port=free_port(),
                    dir=node_dir,
                    process=ServerProcess(
                        f"patroni pg{i}",
                        argv,
                        log_path=self.base_dir / f"pg{i}.log",
                        env=_patroni_env(),
                    ),
                )
            )

    # -- lifecycle -----------------------------------------------------------------------

    def start(self, timeout: float = 120.0) -> None:
        """Start every node (the first bootstraps, the others clone it) and wait until there
        is a primary and every other node is its synchronous standby."""
        self._prepare()
        deadline = time.monotonic() + timeout
        first, *others = self.nodes
        first.process.start("start")
        if self.wait_primary(max(1.0, deadline - time.monotonic())) is None:
            raise ServiceError(f"no Patroni primary within {timeout:g} s:\n{self.log_tails()}")
        for node in others:
            node.process.start("start")
        if not self.wait_replicated(max(1.0, deadline - time.monotonic())):
            raise ServiceError(
                f"the standbys were not synchronous within {timeout:g} s:\n{self.log_tails()}"
            )

    def cleanup(self) -> None:
        """Stop both Patroni processes (each stops its Postgres), then kill by PID whatever
        is left of them, and delete the directory."""
        for node in self.nodes:
            pids = [p for p in (node.process.pid, node.postmaster_pid()) if p is not None]
            tree = [d for p in pids for d in descendants(p)]
            with contextlib.suppress(Exception):
                node.process.stop(_STOP_SECONDS)
            left = [p for p in (*pids, *tree, node.postmaster_pid()) if p and pid_alive(p)]
            if left:
                kill_and_reap(left)
        shutil.rmtree(self.base_dir, ignore_errors=True)

    # -- views ---------------------------------------------------------------------------

    def hosts(self) -> list[tuple[str, int]]:
        return [("127.0.0.1", node.pg_port) for node in self.nodes]

    def primary(self) -> PatroniNode | None:
        """The node whose REST API says it is the primary (GET /primary answers 200)."""
        for node in self.nodes:
            if _get(f"{node.rest}/primary") == 200:
                return node
        return None

    def wait_primary(
        self, timeout: float, *, other_than: PatroniNode | None = None
    ) -> PatroniNode | None:
        """The primary once there is one (not `other_than`), or None after `timeout`."""
        deadline = time.monotonic() + timeout
        for _ in range(int(timeout / _POLL_SECONDS) + 2):
            found = self.primary()
            if found is not None and found is not other_than:
                return found
            if time.monotonic() >= deadline:
                break
            self._check_alive()
            time.sleep(_POLL_SECONDS)
        return None

    def wait_replicated(self, timeout: float) -> bool:
        """Whether, within `timeout`, every node but the primary is a synchronous standby
        (GET /sync answers 200) that streams from it."""
        deadline = time.monotonic() + timeout
        for _ in range(int(timeout / _POLL_SECONDS) + 2):
            primary = self.primary()
            if primary is not None and all(
                _get(f"{node.rest}/sync") == 200 for node in self.nodes if node is not primary
            ):
                return True
            if time.monotonic() >= deadline:
                return False
            self._check_alive()
            time.sleep(_POLL_SECONDS)
        return False

    def patroni_pids(self) -> dict[str, int | None]:
        return {node.name: node.process.pid for node in self.nodes}

    def log_tails(self, lines: int = 30) -> str:
        return "\n".join(
            f"--- {node.name} ({node.process.log_path}) ---\n{tail(node.process.log_path, lines)}"
            for node in self.nodes
        )

    # -- faults --------------------------------------------------------------------------

    def kill_primary_postmaster(self) -> PatroniNode:
        """kill -9 of the primary's postmaster (its backends exit when they notice); Patroni
        stays, and with primary_start_timeout 0 the standby is promoted."""
        primary = self.primary()
        if primary is None:
            raise ServiceError("no primary to kill")
        pid = primary.postmaster_pid()
        if pid is None:
            raise ServiceError(f"{primary.name}: no postmaster.pid")
        os.kill(pid, signal.SIGKILL)
        return primary

    def switchover(self, leader: PatroniNode, candidate: PatroniNode) -> str:
        """A planned switchover through the leader's REST API; its answer."""
        body = json.dumps({"leader": leader.name, "candidate": candidate.name}).encode()
        request = urllib.request.Request(
            f"{leader.rest}/switchover",
            data=body,
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as answer:
                return str(answer.read().decode(errors="replace"))
        except urllib.error.HTTPError as exc:
            raise ServiceError(f"switchover refused: {exc.code} {exc.read()!r}") from exc

    # -- internals -----------------------------------------------------------------------

    def _check_alive(self) -> None:
        for node in self.nodes:
            if node.process.pid is None and node.process.log_path.exists():
                with contextlib.suppress(ServiceError):
                    node.process.check_alive()

    def _prepare(self) -> None:
        self.base_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        owner = pwd.getpwnam(SERVER_USER) if self._as_server_user else None
        for node in self.nodes:
            node.dir.mkdir(mode=0o700, exist_ok=True)
            (node.dir / "sock").mkdir(mode=0o700, exist_ok=True)
            (node.dir / "patroni.yml").write_text(json.dumps(self._config(node), indent=1))
        if owner is not None:
            for path in [self.base_dir, *self.base_dir.rglob("*")]:
                os.chown(path, owner.pw_uid, owner.pw_gid)

    def _config(self, node: PatroniNode) -> dict[str, object]:
        hba = [
            "local all all trust",
            "host all all 127.0.0.1/32 trust",
            "host replication all 127.0.0.1/32 trust",
        ]
        return {
            "scope": self.scope,
            "namespace": f"/patroni-{self.id}/",
            "name": node.name,
            "log": {"level": "INFO"},
            "restapi": {
                "listen": f"127.0.0.1:{node.rest_port}",
                "connect_address": f"127.0.0.1:{node.rest_port}",
            },
            "zookeeper": {"hosts": self.zookeeper.split(",")},
            "bootstrap": {
                "dcs": {
                    "ttl": 10,
                    "loop_wait": 1,
                    "retry_timeout": 5,
                    "maximum_lag_on_failover": 1048576,
                    "synchronous_mode": True,
                    # without it a kill -9'd primary is restarted in place, not failed over
                    "primary_start_timeout": 0,
                    "postgresql": {
                        "use_pg_rewind": False,
                        "parameters": {"max_connections": 300, "wal_keep_size": "256MB"},
                    },
                },
                "initdb": [{"encoding": "UTF8"}, {"locale": "C.UTF-8"}, "no-sync"],
            },
            "postgresql": {
                "listen": f"127.0.0.1:{node.pg_port}",
                "connect_address": f"127.0.0.1:{node.pg_port}",
                "data_dir": str(node.data_dir),
                "bin_dir": str(self.bindir),
                "pgpass": str(node.dir / "pgpass"),
                "authentication": {
                    "superuser": {"username": "postgres"},
                    "replication": {"username": "postgres"},
                },
                "pg_hba": hba,
                "parameters": {
                    "unix_socket_directories": str(node.dir / "sock"),
                    # tests only: durability against a machine crash is not what is tested
                    # (kill -9 of a postmaster loses nothing acknowledged with fsync off)
                    "fsync": "off",
                    "full_page_writes": "off",
                },
            },
        }


def _patroni_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PG", "PATRONI"))}
    return env | {"LC_ALL": "C.UTF-8", "LANG": "C.UTF-8", "HOME": "/var/lib/postgresql"}


def _get(url: str) -> int | None:
    """The HTTP status of GET `url`, None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=_HTTP_TIMEOUT_SECONDS) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (OSError, ValueError):
        return None
