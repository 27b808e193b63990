"""scheduled-d as a systemd service, tested on real processes: sd_notify messages on a real
AF_UNIX datagram socket (READY=1, STATUS=, WATCHDOG=1, STOPPING=1), SIGHUP that re-reads
the log level without touching a running command, check-config errors naming FILE:LINE and
the key, a port in use, the log formats, refused log levels, --version, and the shipped
units through systemd-analyze (verify; security at most 4.0)."""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from sqlalchemy import select

from schedctl import __version__
from schedctl.storage.db import schema
from schedctl.storage.db.store import Store
from tests.acceptance.process_support import (
    WAIT_SECONDS,
    killed_if_left,
    stops_on_sigterm,
    wait_for,
)
from tests.factories import create_job, make_tenant, once_at
from tests.services.ports import free_port

BIN = Path(sys.executable).parent
SCHEDULED_D = BIN / "scheduled-d"
REPO = Path(__file__).resolve().parents[2]


class NotifySocket:
    """The service manager's end: a bound AF_UNIX datagram socket that collects messages."""

    def __init__(self) -> None:
        # a short path: sun_path holds 108 bytes, pytest's tmp_path can be longer
        self.dir = Path(tempfile.mkdtemp(prefix="sdn-"))
        self.path = self.dir / "notify"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(self.path))
        self.messages: list[str] = []

    def receive_until(
        self,
        wanted: str,
        timeout: float = WAIT_SECONDS,
        process: subprocess.Popen[bytes] | None = None,
    ) -> bool:
        """Collect datagrams until one has the line `wanted` (True), the time is up or
        `process` has exited."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(wanted in m.splitlines() for m in self.messages):
                return True
            if process is not None and process.poll() is not None:
                break
            self.sock.settimeout(max(0.01, min(1.0, deadline - time.monotonic())))
            try:
                self.messages.append(self.sock.recv(4096).decode())
            except TimeoutError:
                continue
        return any(wanted in m.splitlines() for m in self.messages)

    def lines(self) -> list[str]:
        return [line for m in self.messages for line in m.splitlines()]

    def close(self) -> None:
        self.sock.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def notify() -> Iterator[NotifySocket]:
    sock = NotifySocket()
    yield sock
    sock.close()


class Proc:
    """A scheduled-d process with stderr in a file."""

    def __init__(self, tmp_path: Path, args: list[str], env: dict[str, str]) -> None:
        self.log = tmp_path / f"daemon-{len(list(tmp_path.glob('daemon-*')))}.log"
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(
                [str(SCHEDULED_D), *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **env},
                cwd=tmp_path,
            )

    def text(self) -> str:
        return self.log.read_text()

    def terminate(self) -> None:
        """SIGTERM, as systemd stops a service: it must exit 0."""
        self.process.send_signal(signal.SIGTERM)
        assert self.process.wait(60) == 0, self.text()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(30)


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    started: list[Proc] = []
    yield started
    for proc in started:
        proc.stop()


def start_all(
    procs: list[Proc], tmp_path: Path, sqlite_url: str, config: Path, env: dict[str, str]
) -> Proc:
    """`scheduled-d all` over `sqlite_url` and `config`, stopped at the test's end."""
    proc = Proc(tmp_path, ["all", "--db", sqlite_url, "--config", str(config)], env)
    procs.append(proc)
    return proc


def worker_config(tmp_path: Path, command: list[str], extra: str = "") -> Path:
    config = tmp_path / "scheduled.toml"
    config.write_text(
        "poll_interval_seconds = 0.1\n"
        + extra
        + f'[[worker]]\nqueue = "q"\ncommand = {json.dumps(command)}\nlease_seconds = 5\n'
    )
    return config


# -- sd_notify ---------------------------------------------------------------------------------


@pytest.fixture
def true_worker(tmp_path: Path, sqlite_url: str) -> Path:
    """The configuration of a worker running /bin/true, and the tenant whose queue it serves
    (which has to exist)."""
    store = Store.open(sqlite_url)
    try:
        make_tenant(store)
    finally:
        store.close()
    return worker_config(tmp_path, ["/bin/true"])


def test_all_sends_ready_status_watchdog_and_stopping(
    tmp_path: Path, sqlite_url: str, notify: NotifySocket, procs: list[Proc], true_worker: Path
) -> None:
    config = true_worker
    env = {"NOTIFY_SOCKET": str(notify.path), "WATCHDOG_USEC": "200000"}
    proc = start_all(procs, tmp_path, sqlite_url, config, env)
    assert notify.receive_until("READY=1", process=proc.process), proc.text()
    statuses = [line for line in notify.lines() if line.startswith("STATUS=")]
    assert "STATUS=dispatcher: 1024 partitions; relay; 1 workers" in statuses, notify.messages
    # WATCHDOG_USEC=200000: a ping every 0.1 s while the components run
    assert notify.receive_until("WATCHDOG=1"), (notify.messages, proc.text())
    proc.process.send_signal(signal.SIGTERM)
    assert notify.receive_until("STOPPING=1"), (notify.messages, proc.text())
    assert proc.process.wait(60) == 0, proc.text()
    lines = notify.lines()
    assert lines.index("READY=1") < lines.index("STOPPING=1")


def test_relay_notifies_on_an_abstract_socket(
    tmp_path: Path, sqlite_url: str, procs: list[Proc]
) -> None:
    name = f"scheduled-test-{os.getpid()}-{time.monotonic_ns()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        sock.bind(b"\0" + name.encode())
        sock.settimeout(WAIT_SECONDS)
        proc = Proc(tmp_path, ["relay", "--db", sqlite_url], {"NOTIFY_SOCKET": "@" + name})
        procs.append(proc)
        message = sock.recv(4096).decode()
        assert message.splitlines() == ["READY=1", "STATUS=relay"], message
        proc.process.send_signal(signal.SIGTERM)
        assert "STOPPING=1" in sock.recv(4096).decode().splitlines()
        assert proc.process.wait(60) == 0, proc.text()
    finally:
        sock.close()


# -- SIGHUP ------------------------------------------------------------------------------------


def test_sighup_rereads_the_log_level_and_keeps_a_running_command(
    tmp_path: Path, sqlite_url: str, notify: NotifySocket, procs: list[Proc]
) -> None:
    started, release, done = tmp_path / "started", tmp_path / "release", tmp_path / "done"
    script = (
        f"touch {started}; while [ ! -e {release} ]; do sleep 0.05; done; "
        f"echo finished > {done}; cat >/dev/null"
    )
    config = worker_config(tmp_path, ["/bin/sh", "-c", script], 'log_level = "INFO"\n')
    store = Store.open(sqlite_url)
    try:
        tenant = make_tenant(store)
        job_id = create_job(store, tenant, once_at(datetime.now(UTC)))
        proc = start_all(procs, tmp_path, sqlite_url, config, {"NOTIFY_SOCKET": str(notify.path)})
        assert wait_for(started.exists), proc.text()
        config.write_text(config.read_text().replace('"INFO"', '"WARNING"'))
        proc.process.send_signal(signal.SIGHUP)
        assert wait_for(lambda: "log level WARNING" in proc.text()), proc.text()
        assert proc.process.poll() is None, proc.text()  # SIGHUP did not kill it
        release.touch()
        assert wait_for(done.exists), proc.text()

        def succeeded() -> bool:
            with store.read() as connection:
                rows = connection.execute(
                    select(schema.runs.c.status).where(schema.runs.c.job_id == job_id)
                ).all()
            return [r[0] for r in rows] == ["succeeded"]

        assert wait_for(succeeded), proc.text()
        proc.terminate()
        # WARNING from now on: the INFO line "stopped" is no longer written
        assert "scheduled-d all: stopped" not in proc.text()
    finally:
        store.close()


def test_sighup_with_a_broken_configuration_keeps_the_old_one(
    tmp_path: Path, sqlite_url: str, notify: NotifySocket, procs: list[Proc], true_worker: Path
) -> None:
    config = true_worker
    proc = start_all(procs, tmp_path, sqlite_url, config, {"NOTIFY_SOCKET": str(notify.path)})
    assert notify.receive_until("READY=1", process=proc.process), proc.text()
    config.write_text(config.read_text() + "concurency = 4\n")
    proc.process.send_signal(signal.SIGHUP)
    assert wait_for(lambda: "configuration not reloaded" in proc.text()), proc.text()
    assert "concurency" in proc.text()
    proc.terminate()


# -- check-config --------------------------------------------------------------------------------


def check_config(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(SCHEDULED_D), "check-config", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def test_check_config_accepts_the_shipped_example_and_a_worker(tmp_path: Path) -> None:
    result = check_config(str(REPO / "config" / "scheduled.toml"))
    assert result.returncode == 0, result.stderr
    config = worker_config(tmp_path, ["/bin/true"], 'metrics_listen = "127.0.0.1:0"\n')
    result = check_config(str(config))
    assert result.returncode == 0, result.stderr
    assert "ok (1 [[worker]] table(s))" in result.stdout


def test_check_config_names_an_unknown_worker_key_and_its_line(tmp_path: Path) -> None:
    config = tmp_path / "scheduled.toml"
    config.write_text(
        "# two workers\n"
        '[[worker]]\nqueue = "a"\ncommand = ["/bin/true"]\n'
        "\n"
        '[[worker]]\nqueue = "b"\ncommand = ["/bin/true"]\nconcurency = 4\n'
    )
    result = check_config(str(config))
    assert result.returncode == 2
    assert f"worker.concurency: {config}:9: unknown key" in result.stderr
    assert "(in [[worker]] table 2)" in result.stderr
    assert "did you mean concurrency?" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("text", "line", "key"),
    [
        ('poll_interval_seconds = 0.5\nmetrics_listen = "localhost"\n', 2, "metrics_listen"),
        ('api_listen = "::1:8080"\n', 1, "api_listen"),
        ('\n\nlog_level = "VERBOSE"\n', 3, "log_level"),
        ("retention_days = 0\n", 1, "retention_days"),
        ('partition_count = "many"\n', 1, "partition_count"),
        ('databse_url = "sqlite:///x"\n', 1, "databse_url"),
        ('[[worker]]\nqueue = "q"\ncommand = ["/no/such/program"]\n', 3, "worker.command"),
    ],
)
def test_check_config_errors_name_file_line_and_key(
    tmp_path: Path, text: str, line: int, key: str
) -> None:
    config = tmp_path / "scheduled.toml"
    config.write_text(text)
    result = check_config(str(config))
    assert result.returncode == 2, result.stdout
    assert f"{key}: {config}:{line}: " in result.stderr
    assert "Traceback" not in result.stderr


def test_check_config_and_the_daemon_refuse_a_port_in_use(tmp_path: Path, sqlite_url: str) -> None:
    port = free_port()
    config = tmp_path / "scheduled.toml"
    config.write_text(f'metrics_listen = "127.0.0.1:{port}"\n')
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen(1)
        result = check_config(str(config))
        assert result.returncode == 2
        assert f"metrics_listen: {config}:1: cannot listen on 127.0.0.1:{port}" in result.stderr
        assert check_config("--no-bind", str(config)).returncode == 0
        # at run time: a clear error and exit 2 (no restart by systemd), not a traceback
        run = subprocess.run(
            [str(SCHEDULED_D), "relay", "--db", sqlite_url, "--config", str(config)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert run.returncode == 2, run.stderr
    assert f"metrics_listen: cannot listen on 127.0.0.1:{port}" in run.stderr
    assert "Traceback" not in run.stderr


# -- logging, levels, version ---------------------------------------------------------------------


def run_relay_until_ready(
    tmp_path: Path, sqlite_url: str, notify: NotifySocket, args: list[str], env: dict[str, str]
) -> str:
    log = tmp_path / "relay.log"
    with log.open("wb") as out:
        if "JOURNAL_STREAM" in env:  # stderr is "the journal": the file's device and inode
            st = os.fstat(out.fileno())
            env = {**env, "JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}
        process = subprocess.Popen(
            [str(SCHEDULED_D), "relay", "--db", sqlite_url, *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "NOTIFY_SOCKET": str(notify.path), **env},
        )
        with killed_if_left(process):
            assert notify.receive_until("READY=1", process=process), log.read_text()
            stops_on_sigterm(process, log)
    return log.read_text()


@pytest.mark.parametrize(
    ("args", "env"),
    [(["--log-format", "json"], {}), ([], {"SCHEDULED_LOG_FORMAT": "json"})],
)
def test_json_log_lines_parse(
    tmp_path: Path, sqlite_url: str, notify: NotifySocket, args: list[str], env: dict[str, str]
) -> None:
    text = run_relay_until_ready(
        tmp_path, sqlite_url, notify, args, {"SCHEDULED_LOG_LEVEL": "DEBUG", **env}
    )
    entries = [json.loads(line) for line in text.splitlines()]
    assert entries, text
    for entry in entries:
        assert {"time", "level", "logger", "message"} <= entry.keys()
        assert entry["time"].endswith("Z")
    assert any("finishing in-flight work" in e["message"] for e in entries)


def test_text_lines_under_journald_have_a_priority_prefix_and_no_time(
    tmp_path: Path, sqlite_url: str, notify: NotifySocket
) -> None:
    text = run_relay_until_ready(tmp_path, sqlite_url, notify, [], {"JOURNAL_STREAM": "x"})
    lines = text.splitlines()
    assert lines, text
    for line in lines:
        assert re.match(r"<[0-7]>(DEBUG|INFO|WARNING|ERROR|CRITICAL) \S+: ", line), line
    assert any(line.startswith("<6>INFO ") for line in lines)


@pytest.mark.parametrize(
    ("args", "env", "said"),
    [
        ([], {"SCHEDULED_LOG_LEVEL": "VERBOSE"}, "SCHEDULED_LOG_LEVEL: unknown log level"),
        (["--log-format", "xml"], {}, "--log-format: unknown log format 'xml'"),
        ([], {"SCHEDULED_LOG_FORMAT": "yaml"}, "SCHEDULED_LOG_FORMAT: unknown log format"),
    ],
)
def test_invalid_log_settings_exit_2(
    sqlite_url: str, args: list[str], env: dict[str, str], said: str
) -> None:
    result = subprocess.run(
        [str(SCHEDULED_D), "relay", "--db", sqlite_url, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )
    assert result.returncode == 2
    assert said in result.stderr
    assert "Traceback" not in result.stderr


def test_version() -> None:
    for program in ("scheduled-d", "schedctl"):
        result = subprocess.run(
            [str(BIN / program), "--version"], capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == f"{program} {__version__}"


# -- the worker unit's command: from its [[worker]] table, no shell ------------------------------


def test_worker_takes_its_command_from_its_worker_table(tmp_path: Path, sqlite_url: str) -> None:
    out = tmp_path / "out"
    # an argument with spaces and a $: passed as one argv word, no shell in between
    config = worker_config(tmp_path, ["/bin/sh", "-c", f'printf %s "$0" > {out}', "a b $HOME"])
    store = Store.open(sqlite_url)
    try:
        create_job(store, make_tenant(store), once_at(datetime.now(UTC)))
        # the due run reaches the queue through a dispatcher and a relay (`all`, no workers)
        empty = tmp_path / "empty.toml"
        empty.write_text("poll_interval_seconds = 0.1\n")
        feeder = subprocess.Popen(
            [str(SCHEDULED_D), "all", "--db", sqlite_url, "--config", str(empty)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            result = subprocess.run(
                [
                    str(SCHEDULED_D),
                    "worker",
                    "--queue",
                    "q",
                    "--max-runs",
                    "1",
                    "--db",
                    sqlite_url,
                    "--config",
                    str(config),
                ],
                capture_output=True,
                text=True,
                timeout=WAIT_SECONDS,
            )
        finally:
            feeder.terminate()
            feeder.wait(60)
        assert result.returncode == 0, result.stderr
        assert out.read_text() == "a b $HOME"
    finally:
        store.close()


def test_worker_without_command_or_table_is_a_config_error(sqlite_url: str) -> None:
    result = subprocess.run(
        [str(SCHEDULED_D), "worker", "--queue", "nothing", "--db", sqlite_url],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "no [[worker]] table with queue = 'nothing'" in result.stderr


# -- MemoryDenyWriteExecute ----------------------------------------------------------------------

PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN = 65, 1
MDWE_LAUNCHER = f"""
import ctypes, os, sys
if ctypes.CDLL(None, use_errno=True).prctl({PR_SET_MDWE}, {PR_MDWE_REFUSE_EXEC_GAIN}, 0, 0, 0):
    sys.exit(77)
os.execv(sys.argv[1], sys.argv[1:])
"""


def test_all_with_the_api_runs_without_writable_executable_memory(
    tmp_path: Path, sqlite_url: str, notify: NotifySocket
) -> None:
    """The units set MemoryDenyWriteExecute=yes: the same kernel rule (prctl PR_SET_MDWE,
    kept across exec) on the whole stack, API, crypto and database drivers included."""
    config = tmp_path / "scheduled.toml"
    config.write_text(f'api_enabled = true\napi_listen = "127.0.0.1:{free_port()}"\n')
    log = tmp_path / "mdwe.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [
                sys.executable,
                "-c",
                MDWE_LAUNCHER,
                str(SCHEDULED_D),
                "all",
                "--db",
                sqlite_url,
                "--config",
                str(config),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "NOTIFY_SOCKET": str(notify.path)},
        )
        with killed_if_left(process):
            ready = notify.receive_until("READY=1", process=process)
            if process.poll() == 77:
                pytest.skip("this kernel has no PR_SET_MDWE (Linux >= 6.3)")
            assert ready, log.read_text()
            assert any(line.endswith("; api") for line in notify.lines()), notify.messages
            stops_on_sigterm(process, log)


# -- the units -------------------------------------------------------------------------------------

# the daemons' services; the owner's maintenance is a oneshot service and its timer
MAINTENANCE = ("scheduled-d-maintain.service", "scheduled-d-maintain.timer")
UNITS = sorted(p.name for p in (REPO / "systemd").glob("*.service") if p.name not in MAINTENANCE)
SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(
    SYSTEMD_ANALYZE is None, reason="systemd-analyze is not installed (apt install systemd)"
)


def installed_units(tmp_path: Path) -> Path:
    """The units as `make install` lays them out, with ExecStart= on this checkout's binary
    (verify checks that it exists) and the man pages in a MANPATH tree (verify runs man for
    Documentation=); the worker template instantiated for a queue."""
    units = tmp_path / "units"
    units.mkdir()
    for name in (*UNITS, *MAINTENANCE):
        text = (REPO / "systemd" / name).read_text()
        text = text.replace("/usr/local/bin/scheduled-d", str(SCHEDULED_D))
        text = text.replace("/usr/local/bin/schedctl", str(BIN / "schedctl"))
        (units / name).write_text(text)
    template = units / "scheduled-d-worker@.service"
    shutil.copy(template, units / "scheduled-d-worker@backups.service")
    man = tmp_path / "man"
    for page in (REPO / "man").iterdir():
        section = man / f"man{page.suffix.lstrip('.')}"
        section.mkdir(parents=True, exist_ok=True)
        shutil.copy(page, section / page.name)
    return units


def test_units_are_notify_services_after_the_network_without_a_shell() -> None:
    assert {"scheduled-d-api.service", "scheduled-d-dispatcher.service"} <= set(UNITS)
    for name in UNITS:
        text = (REPO / "systemd" / name).read_text()
        settings = [line for line in text.splitlines() if not line.startswith("#")]
        assert "Wants=network-online.target" in settings, name
        assert "After=network-online.target" in settings, name
        assert "Type=notify" in settings, name
        assert any(s.startswith("WatchdogSec=") for s in settings), name
        assert "ExecReload=/bin/kill -HUP $MAINPID" in settings, name
        exec_start = next(s for s in settings if s.startswith("ExecStart="))
        assert "/bin/sh" not in exec_start and "$" not in exec_start, (name, exec_start)


def ip_address_deny(unit: str) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    """The unit's IPAddressDeny= list as systemd builds it: each line adds its entries, an
    empty one clears the list."""
    denied: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
    for line in (REPO / "systemd" / unit).read_text().splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "IPAddressDeny":
            if not value.strip():
                denied.clear()
            denied.extend(ipaddress.ip_network(entry) for entry in value.split())
    return denied


@pytest.mark.parametrize("unit", ["scheduled-d-relay.service", "scheduled-d-all.service"])
def test_the_relay_units_deny_link_local_and_metadata_addresses(unit: str) -> None:
    denied = ip_address_deny(unit)

    def blocked(address: str) -> bool:
        ip = ipaddress.ip_address(address)
        return any(ip.version == net.version and ip in net for net in denied)

    metadata = [
        "169.254.169.254",  # AWS, GCP, Azure, OCI, DigitalOcean
        "169.254.170.2",  # AWS ECS task credentials
        "169.254.170.23",  # AWS EKS pod identity
        "169.254.0.1",  # any IPv4 link-local
        "168.63.129.16",  # Azure WireServer
        "100.100.100.200",  # Alibaba
        "192.0.0.192",  # OCI legacy
        "fd00:ec2::254",  # AWS IMDS over IPv6
        "fd00:ec2::23",  # AWS EKS pod identity over IPv6
        "fd20:ce::254",  # GCP metadata over IPv6
        "fe80::1",  # any IPv6 link-local
        "febf::1",
    ]
    assert [a for a in metadata if not blocked(a)] == []
    # the databases, ZooKeeper and webhooks stay reachable: loopback, private, public
    reachable = ["127.0.0.1", "::1", "10.0.0.5", "192.168.1.10", "fd00::5", "93.184.216.34"]
    assert [a for a in reachable if blocked(a)] == []
    # an allow list would win over the deny list in systemd, undoing it
    settings = (REPO / "systemd" / unit).read_text().splitlines()
    assert not any(line.startswith("IPAddressAllow=") for line in settings)


def test_the_maintenance_timer_runs_db_maintain_as_the_owner() -> None:
    service = (REPO / "systemd" / "scheduled-d-maintain.service").read_text().splitlines()
    timer = (REPO / "systemd" / "scheduled-d-maintain.timer").read_text().splitlines()
    assert "Type=oneshot" in service
    assert "ExecStart=/usr/local/bin/schedctl db maintain --days-ahead 7" in service
    # the owner's URL comes last, so it overrides the daemons' runtime-role URL
    files = [line for line in service if line.startswith("EnvironmentFile=")]
    assert files[-1] == "EnvironmentFile=/etc/scheduled/owner.env"
    assert "Persistent=true" in timer and "WantedBy=timers.target" in timer


@needs_analyze
def test_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    units = installed_units(tmp_path)
    paths = [str(units / n) for n in UNITS if n != "scheduled-d-worker@.service"]
    paths.append(str(units / "scheduled-d-worker@backups.service"))
    paths.extend(str(units / n) for n in MAINTENANCE)
    result = subprocess.run(
        [str(SYSTEMD_ANALYZE), "verify", *paths],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "MANPATH": str(tmp_path / "man")},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    # no complaint about our units (the host's own units may have theirs)
    ours = [line for line in result.stderr.splitlines() if "scheduled-d" in line]
    assert ours == [], result.stderr


@needs_analyze
@pytest.mark.parametrize(
    ("unit", "limit"),
    [
        ("scheduled-d-dispatcher.service", 4.0),
        ("scheduled-d-relay.service", 4.0),
        ("scheduled-d-api.service", 4.0),
        ("scheduled-d-all.service", 4.0),
        # runs other programs: no MemoryDenyWriteExecute (JITs), nice/ulimit allowed
        ("scheduled-d-worker@backups.service", 4.0),
        # the cron replacement runs as root, as cron does, so that jobs run as their users:
        # kernel-facing settings only (the unit says how to tighten it for one user)
        ("scheduled-d-host.service", 8.0),
        # holds the database owner's URL: as tight as the daemons
        ("scheduled-d-maintain.service", 4.0),
    ],
)
def test_units_security_exposure(tmp_path: Path, unit: str, limit: float) -> None:
    units = installed_units(tmp_path)
    result = subprocess.run(
        [str(SYSTEMD_ANALYZE), "security", "--offline=true", str(units / unit)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    found = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", result.stdout)
    assert found, result.stdout + result.stderr
    assert float(found.group(1)) <= limit, result.stdout
