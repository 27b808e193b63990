"""Configuration: one TOML file read by schedctl and scheduled-d; flag > environment > file >
defaults. Secrets are read from files or the environment and never printed."""

from __future__ import annotations

import difflib
import math
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import platformdirs

from schedctl.core import errors, limits
from schedctl.core.limits import MAX_LEASE_SECONDS, MAX_WORKER_CONCURRENCY, MIN_LEASE_SECONDS
from schedctl.domain.alerts.policy import AlertPolicy, parse_policy

DEFAULT_CONFIG_PATH = Path("/etc/scheduled/scheduled.toml")
ENV_PREFIX = "SCHEDULED_"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
LOG_FORMATS = ("text", "json")
# every key a [[worker]] table may hold (tenant and env: the worker's tenant and the
# variables added to its command's environment)
WORKER_KEYS = (
    "queue",
    "command",
    "concurrency",
    "lease_seconds",
    "tenant",
    "env",
    "alert_command",
    "output_bytes",
)
# A command's environment: what a worker adds to it must be a valid name, never one of the
# worker's own SCHEDULED_* settings (database URL, keys, token) and never a run variable.
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
RUN_VARIABLES = frozenset(
    {"SCHED_JOB_ID", "SCHED_SCHEDULED_AT", "SCHED_ATTEMPT", "SCHED_IDEMPOTENCY_KEY"}
)
# every key the [host] table may hold (the host worker: job files, issue 11)
HOST_KEYS = (
    "name",
    "groups",
    "jobs_dir",
    "tenant",
    "concurrency",
    "output_bytes",
    "rescan_seconds",
    "api_url",
    "token_file",
    "state_dir",
    "boot_id_file",
)
MAX_HOST_OUTPUT_BYTES = 1024 * 1024
MAX_RESCAN_SECONDS = 86_400.0
_GROUP = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}", re.ASCII)


def default_database_url() -> str:
    """The embedded default: a SQLite file in the user's data directory."""
    data_dir = Path(platformdirs.user_data_dir("scheduled", appauthor=False))
    return f"sqlite:///{data_dir / 'scheduled.db'}"


@dataclass(frozen=True)
class WorkerConfig:
    queue: str
    command: tuple[str, ...]
    concurrency: int = 1
    lease_seconds: float = 30.0
    env: tuple[tuple[str, str], ...] = ()  # [worker.env]: added to the command's environment
    tenant: str | None = None  # name or id; may be left out while one tenant exists
    # run with an alert's JSON on stdin for each command alert of this queue's jobs
    alert_command: tuple[str, ...] = ()
    # the end of stdout and of stderr kept per run in the run history (`schedctl logs`)
    output_bytes: int = limits.DEFAULT_OUTPUT_BYTES


@dataclass(frozen=True)
class HostConfig:
    """The [host] table: this host's identity and its worker for job files."""

    name: str = field(default_factory=lambda: os.uname().nodename)
    groups: tuple[str, ...] = ()
    jobs_dir: str = "/etc/scheduled/jobs.d"
    tenant: str | None = None  # name or id; may be left out while one tenant exists
    concurrency: int = 4  # commands at once, per queue served
    output_bytes: int = 65536  # of each run's output kept in the run history
    rescan_seconds: float = 10.0  # how often the job files are checked for changes
    # the REST API to lease through with a host token (no database URL on the host), and
    # the file holding that token (else SCHEDULED_API_TOKEN)
    api_url: str | None = None
    token_file: str | None = None
    # where the worker keeps its own state across restarts (boot-runs.json: the @reboot
    # jobs run in the current boot), and the kernel's boot id that says which boot it is
    state_dir: str = "/var/lib/scheduled"
    boot_id_file: str = "/proc/sys/kernel/random/boot_id"


@dataclass(frozen=True)
class Config:
    database_url: str = field(default_factory=default_database_url)
    zookeeper: str | None = None  # "host:port,host:port"; None: in-process coordinator
    zookeeper_root: str = "/scheduled"
    # ZooKeeper security (schedctl/coordination/zkaccess.py): a file holding one line
    # "user:password" for digest auth and the ACL of every node the scheduler creates (or
    # SCHEDULED_ZOOKEEPER_AUTH; never the secret itself in this file), and TLS: on with
    # zookeeper_tls or a CA file; a client certificate and its key if the server asks
    zookeeper_auth_file: str | None = None
    zookeeper_tls: bool = False
    zookeeper_tls_ca: str | None = None
    zookeeper_tls_cert: str | None = None
    zookeeper_tls_key: str | None = None
    session_timeout_seconds: float = 10.0
    partition_count: int = 1024
    node_name: str = field(default_factory=lambda: f"{os.uname().nodename}-{os.getpid()}")
    claim_batch_size: int = 5000
    poll_interval_seconds: float = 0.25
    preload_window_seconds: float = 60.0
    max_payload_bytes: int = 64 * 1024
    retention_days: int = 90
    dead_letter_retention_days: int = 30
    alert_retention_days: int = 30
    audit_retention_days: int = 365
    # jobs with `metrics = true` (per-job series on /metrics) a tenant may have at once:
    # each such job adds a few series to every scrape; 0: none may
    metrics_max_jobs_per_tenant: int = 100
    metrics_listen: str | None = None  # "host:port" for /metrics and /healthz
    api_listen: str = "127.0.0.1:8080"
    api_enabled: bool = False
    # the relay: lease of a claimed run without a heartbeat (unset: 9 s, or more when the
    # HTTP deadline needs it), the wall-clock deadline of one HTTP call (unset: 7 s, or
    # shorter than a configured lease by its margin), deliveries at once, and a PEM file of
    # the CAs HTTPS endpoints are checked against (unset: the bundled public CAs)
    relay_lease_seconds: float | None = None
    http_timeout_seconds: float | None = None
    relay_max_in_flight: int = 256
    http_ca_bundle: str | None = None
    log_level: str = "INFO"  # SCHEDULED_LOG_LEVEL; re-read on SIGHUP
    log_format: str = "text"  # text | json; SCHEDULED_LOG_FORMAT, --log-format
    workers: tuple[WorkerConfig, ...] = ()
    host: HostConfig | None = None  # [host]: the job-file worker of this host
    # e-mail alerts: the SMTP server (unset smtp_host: e-mail alerts wait, retried, and the
    # relay logs why), its port, the From address, STARTTLS, and a file holding
    # "user:password" for AUTH (never the secret itself in the configuration)
    smtp_host: str | None = None
    smtp_port: int = 25
    smtp_from: str = "scheduled@localhost"
    smtp_starttls: bool = False
    smtp_credentials_file: str | None = None
    # [alerts]: the recipient domains e-mail alerts may go to and the alerts a tenant may
    # have sent per hour (schedctl.domain.alerts.policy)
    alerts: AlertPolicy = field(default_factory=AlertPolicy)
    source: str = "defaults"  # where the config came from, for `schedctl status`
    config_file: str | None = None  # the file read, if any
    # where database_url came from: "defaults" (the embedded per-user SQLite file), the
    # file, SCHEDULED_DATABASE_URL or the flag
    database_url_from: str = "defaults"

    @property
    def alert_policy(self) -> AlertPolicy:
        """[alerts] as it applies here: with an SMTP server, an unset domain list allows no
        recipient."""
        return replace(self.alerts, smtp_configured=bool(self.smtp_host))


_SCALARS: dict[str, type] = {
    "database_url": str,
    "zookeeper": str,
    "zookeeper_root": str,
    "zookeeper_auth_file": str,
    "zookeeper_tls": bool,
    "zookeeper_tls_ca": str,
    "zookeeper_tls_cert": str,
    "zookeeper_tls_key": str,
    "session_timeout_seconds": float,
    "partition_count": int,
    "node_name": str,
    "claim_batch_size": int,
    "poll_interval_seconds": float,
    "preload_window_seconds": float,
    "max_payload_bytes": int,
    "retention_days": int,
    "dead_letter_retention_days": int,
    "alert_retention_days": int,
    "audit_retention_days": int,
    "metrics_max_jobs_per_tenant": int,
    "metrics_listen": str,
    "api_listen": str,
    "api_enabled": bool,
    "relay_lease_seconds": float,
    "http_timeout_seconds": float,
    "relay_max_in_flight": int,
    "http_ca_bundle": str,
    "log_level": str,
    "log_format": str,
    "smtp_host": str,
    "smtp_port": int,
    "smtp_from": str,
    "smtp_starttls": bool,
    "smtp_credentials_file": str,
}


def _coerce(key: str, value: Any, origin: str) -> Any:
    kind = _SCALARS[key]
    try:
        if kind is bool and isinstance(value, str):
            if value.lower() not in {"1", "0", "true", "false", "yes", "no"}:
                raise ValueError(value)
            return value.lower() in {"1", "true", "yes"}
        if kind is int and isinstance(value, bool):
            raise ValueError(value)
        if kind in (int, float) and isinstance(value, str):
            # ASCII digits only (int() and float() also read other scripts' digits), and no
            # more of them than any setting can use (int() refuses thousands with ValueError)
            text = value.strip()
            if not text.isascii() or len(text) > limits.MAX_NUMBER_DIGITS:
                raise ValueError(value)
        result = kind(value)
        if kind is float and not math.isfinite(result):
            raise ValueError(value)
        return result
    except (TypeError, ValueError) as exc:
        raise errors.ConfigError(
            f"{origin}: expected {kind.__name__} (ASCII digits), got {limits.describe(value)}",
            field=key,
        ) from exc


def parse_listen(listen: str, field: str, *, default_host: str = "0.0.0.0") -> tuple[str, int]:
    """ "127.0.0.1:9464", "[::1]:9464" or ":9464" (every interface) -> (host, port); anything
    else (a host without a port, a bare IPv6 address) is a ConfigError naming `field`."""
    host, sep, port_text = listen.strip().rpartition(":")
    example = "e.g. 127.0.0.1:9464, [::1]:9464 or :9464"
    if not sep or not port_text.isascii() or not port_text.isdigit():
        raise errors.ConfigError(f"{listen!r} is not HOST:PORT ({example})", field=field)
    if int(port_text) > 65535:
        raise errors.ConfigError(f"{listen!r}: the port must be at most 65535", field=field)
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise errors.ConfigError(
            f"{listen!r}: an IPv6 address goes in brackets ({example})", field=field
        )
    return host or default_host, int(port_text)


_POSITIVE = (
    "session_timeout_seconds",
    "partition_count",
    "claim_batch_size",
    "poll_interval_seconds",
    "preload_window_seconds",
    "max_payload_bytes",
    "retention_days",
    "dead_letter_retention_days",
    "alert_retention_days",
    "audit_retention_days",
)


# files the ZooKeeper client reads (zkaccess reads and checks their content)
_ZOOKEEPER_FILES = (
    "zookeeper_auth_file",
    "zookeeper_tls_ca",
    "zookeeper_tls_cert",
    "zookeeper_tls_key",
)


def _check_value(key: str, value: Any, origin: str) -> Any:
    """Range and form of one setting (after its type): a ConfigError naming the key."""
    if key in _POSITIVE and not value > 0:
        raise errors.ConfigError(f"{origin}: must be greater than 0, got {value!r}", field=key)
    if key in ("metrics_listen", "api_listen"):
        parse_listen(value, key)
    if key == "metrics_max_jobs_per_tenant" and not 0 <= value <= limits.MAX_QUOTA:
        raise errors.ConfigError(
            f"{origin}: must be between 0 and {limits.MAX_QUOTA}, got {value!r}", field=key
        )
    if key == "log_level":
        value = value.upper()
        if value not in LOG_LEVELS:
            raise errors.ConfigError(
                f"{origin}: unknown log level {value!r} (one of {', '.join(LOG_LEVELS)})",
                field=key,
            )
    if key == "log_format":
        value = value.lower()
        if value not in LOG_FORMATS:
            raise errors.ConfigError(
                f"{origin}: unknown log format {value!r} (text or json)", field=key
            )
    if key == "smtp_from" and limits.CONTROL_CHARS.search(value):
        # it is the From header of every alert mail
        raise errors.ConfigError(
            f"{origin}: must not contain control or line-separator characters", field=key
        )
    if key in ("database_url", "zookeeper", "node_name", "zookeeper_root") and not value.strip():
        raise errors.ConfigError(f"{origin}: must not be empty", field=key)
    if key in _ZOOKEEPER_FILES and (not value.startswith("/") or "\0" in value):
        raise errors.ConfigError(
            f"{origin}: must be an absolute file path, got {limits.describe(value)}", field=key
        )
    return value


def _file_type_ok(key: str, value: Any) -> bool:
    """A value in the file has its TOML type (environment values are coerced from text)."""
    kind = _SCALARS[key]
    if kind is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


_HEADER = re.compile(r"^\s*(\[\[?)\s*([^\]]+?)\s*\]")
_KEY = re.compile(r"""^\s*["']?([A-Za-z0-9_-]+)["']?\s*=""")


def locate(
    text: str, key: str, worker_index: int | None = None, subtable: str | None = None
) -> int | None:
    """The line (1-based) of top-level `key` in TOML `text`, or of `key` in the
    worker_index-th [[worker]] table (in its [worker.SUBTABLE] when given; else that
    table's header); None when not found."""
    section: tuple[object, ...] | str | None = None  # None: the top level
    workers = -1
    header_line = None
    for number, line in enumerate(text.splitlines(), 1):
        header = _HEADER.match(line)
        if header:
            name = header.group(2).replace('"', "").replace("'", "").replace(" ", "")
            if header.group(1) == "[[" and name == "worker":
                workers += 1
                section = ("worker", workers)
                if workers == worker_index:
                    header_line = number
            elif name.startswith("worker.") and workers >= 0:
                section = ("worker", workers, name.split(".", 1)[1])
            else:
                section = name
                if worker_index is None and name.split(".")[0] == key:
                    return number
            continue
        found = _KEY.match(line)
        if found and found.group(1) == key:
            if worker_index is None and section is None:
                return number
            wanted = ("worker", worker_index) + ((subtable,) if subtable else ())
            if worker_index is not None and section == wanted:
                return number
    return header_line


def _located(
    error: errors.ConfigError, origin: str, text: str, field: str, index: int | None = None
) -> errors.ConfigError:
    """`error` again, as "FIELD: FILE:LINE: problem" (the line when the key is found), with
    the [[worker]] table's number when it is about one."""
    parts = field.split(".")
    if index is None:
        line = locate(text, parts[0])
    elif len(parts) > 2:  # worker.env.NAME: NAME in that table's [worker.env]
        line = locate(text, parts[2], index, parts[1])
    else:
        line = locate(text, parts[1] if len(parts) > 1 else "", index)
    problem = str(error)
    for prefix in (f"{error.field}: ", f"{origin}: "):
        if problem.startswith(prefix):
            problem = problem[len(prefix) :]
    where = f"{origin}:{line}" if line else origin
    table = f" (in [[worker]] table {index + 1})" if index is not None else ""
    return errors.ConfigError(f"{where}: {problem}{table}", field=field)


def _unknown(key: str, known: tuple[str, ...] | list[str]) -> str:
    close = difflib.get_close_matches(key, known, n=1)
    return "unknown key" + (f" (did you mean {close[0]}?)" if close else "")


def _file_workers(raw: Any, origin: str, text: str) -> tuple[WorkerConfig, ...]:
    """[[worker]] tables one by one, so that an error names the table and line."""
    if not isinstance(raw, list):
        raise _located(
            errors.ConfigError("must be [[worker]] tables", field="worker"), origin, text, "worker"
        )
    result: list[WorkerConfig] = []
    for index, item in enumerate(raw):
        if isinstance(item, dict):
            for key in item:
                if key not in WORKER_KEYS:
                    error = errors.ConfigError(_unknown(key, WORKER_KEYS), field=f"worker.{key}")
                    raise _located(error, origin, text, f"worker.{key}", index)
        try:
            result.extend(_workers([item], origin))
        except errors.ConfigError as exc:
            raise _located(exc, origin, text, exc.field or "worker", index) from exc
    return tuple(result)


def _host_line(text: str, key: str | None, table: str = "host") -> int | None:
    """The line of `key` in the [host] (or other `table`) table of `text` (of its header
    without a key, or when the key is not found)."""
    header_line = None
    for number, line in enumerate(text.splitlines(), 1):
        header = _HEADER.match(line)
        if header:
            if header_line is not None:
                break
            if header.group(1) == "[" and header.group(2).strip() == table:
                header_line = number
            continue
        found = _KEY.match(line)
        if header_line is not None and key and found and found.group(1) == key:
            return number
    return header_line


def _file_host(raw: Any, origin: str, text: str) -> HostConfig:
    """The [host] table, key by key; an error is "host.KEY: FILE:LINE: problem"."""

    def refuse(key: str | None, problem: str) -> errors.ConfigError:
        line = _host_line(text, key)
        where = f"{origin}:{line}" if line else origin
        name = f"host.{key}" if key else "host"
        return errors.ConfigError(f"{where}: {problem}", field=name)

    if not isinstance(raw, dict):
        raise refuse(None, "must be a [host] table")
    for key in raw:
        if key not in HOST_KEYS:
            raise refuse(key, _unknown(key, HOST_KEYS))
    values: dict[str, Any] = {}
    if "name" in raw:
        from schedctl.domain.jobfiles.placement import HOST_NAME  # here: jobfiles imports config

        name = raw["name"]
        if not isinstance(name, str) or not HOST_NAME.fullmatch(name):
            raise refuse(
                "name",
                "must be 1-63 letters, digits and . _ - starting with a letter or digit, "
                f"got {limits.describe(name)}",
            )
        values["name"] = name
    if "groups" in raw:
        groups = raw["groups"]
        if not isinstance(groups, list) or not all(
            isinstance(g, str) and _GROUP.fullmatch(g) for g in groups
        ):
            raise refuse(
                "groups",
                "must be a list of group names (1-63 letters, digits and . _ - starting "
                f"with a letter or digit), got {limits.describe(groups)}",
            )
        values["groups"] = tuple(dict.fromkeys(groups))
    if "jobs_dir" in raw:
        jobs_dir = raw["jobs_dir"]
        if not isinstance(jobs_dir, str) or not jobs_dir.startswith("/") or "\0" in jobs_dir:
            raise refuse(
                "jobs_dir", f"must be an absolute directory path, got {limits.describe(jobs_dir)}"
            )
        values["jobs_dir"] = os.path.normpath(jobs_dir)
    if "tenant" in raw:
        tenant = raw["tenant"]
        if not isinstance(tenant, str) or not tenant:
            raise refuse("tenant", "must be a tenant name or id")
        values["tenant"] = tenant
    bounds: dict[str, tuple[float, float]] = {
        "concurrency": (1, MAX_WORKER_CONCURRENCY),
        "output_bytes": (0, MAX_HOST_OUTPUT_BYTES),
    }
    for key, (low, high) in bounds.items():
        if key in raw:
            value = raw[key]
            if not limits.is_int(value) or not low <= value <= high:
                raise refuse(
                    key, f"must be an integer from {low} to {high}, got {limits.describe(value)}"
                )
            values[key] = value
    if "rescan_seconds" in raw:
        value = raw["rescan_seconds"]
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not 0 < value <= MAX_RESCAN_SECONDS
        ):
            raise refuse(
                "rescan_seconds",
                f"must be a number of seconds above 0, at most {MAX_RESCAN_SECONDS:.0f}, "
                f"got {limits.describe(value)}",
            )
        values["rescan_seconds"] = float(value)
    if "api_url" in raw:
        api_url = raw["api_url"]
        if not isinstance(api_url, str) or not api_url.startswith(("http://", "https://")):
            raise refuse(
                "api_url", f"must be an http:// or https:// URL, got {limits.describe(api_url)}"
            )
        values["api_url"] = api_url
    if "token_file" in raw:
        token_file = raw["token_file"]
        if not isinstance(token_file, str) or not token_file.startswith("/") or "\0" in token_file:
            raise refuse(
                "token_file", f"must be an absolute file path, got {limits.describe(token_file)}"
            )
        values["token_file"] = token_file
    for key in ("state_dir", "boot_id_file"):
        if key in raw:
            path = raw[key]
            if not isinstance(path, str) or not path.startswith("/") or "\0" in path:
                raise refuse(key, f"must be an absolute path, got {limits.describe(path)}")
            values[key] = os.path.normpath(path)
    return HostConfig(**values)


def _file_alerts(raw: Any, origin: str, text: str) -> AlertPolicy:
    """The [alerts] table; an error is "alerts.KEY: FILE:LINE: problem"."""

    def refuse(key: str | None, problem: str) -> errors.ConfigError:
        line = _host_line(text, key, "alerts")
        where = f"{origin}:{line}" if line else origin
        return errors.ConfigError(f"{where}: {problem}", field=f"alerts.{key}" if key else "alerts")

    return parse_policy(raw, refuse)


def command_env(
    raw: Mapping[Any, Any], where: str, origin: str | None = None
) -> tuple[tuple[str, str], ...]:
    """Checks variables a worker adds to its command's environment (a [worker.env] table,
    --env flags, Worker(env=...)); `where` names them in errors ("worker.env", "--env"),
    `origin` is the file they come from."""
    result = []
    for key, value in raw.items():
        # "worker.env.KEY" for a table, "--env KEY" for a flag
        name = f"{where} {key}" if where.startswith("-") else f"{where}.{key}"

        def refuse(problem: str, name: str = name) -> errors.ConfigError:
            return errors.ConfigError(f"{origin}: {problem}" if origin else problem, field=name)

        if not isinstance(key, str) or not _ENV_NAME.fullmatch(key):
            raise refuse(
                f"{key!r} is not an environment variable name (letters, digits and _, "
                "not starting with a digit)"
            )
        if key.upper().startswith(ENV_PREFIX):
            raise refuse(
                f"{ENV_PREFIX}* variables are the worker's own settings (database URL, "
                "payload keys, API token) and never reach its command"
            )
        if key in RUN_VARIABLES:
            raise refuse("is set by the worker for each run and cannot be configured")
        if not isinstance(value, str):
            raise refuse(f"must be a string, got {value!r}")
        if "\0" in value:
            raise refuse("must not contain a NUL character")
        result.append((key, value))
    return tuple(result)


def _workers(raw: Any, origin: str) -> tuple[WorkerConfig, ...]:
    if not isinstance(raw, list):
        raise errors.ConfigError(f"{origin}: [[worker]] must be a list of tables", field="worker")
    result = []
    for item in raw:
        if not isinstance(item, dict):
            raise errors.ConfigError(f"{origin}: each [[worker]] is a table", field="worker")
        queue, command = item.get("queue"), item.get("command")
        if not isinstance(queue, str) or not queue:
            raise errors.ConfigError(
                f"{origin}: [[worker]] needs a queue name", field="worker.queue"
            )
        if isinstance(command, str):
            command = [command]
        if (
            not isinstance(command, list)
            or not command
            or not all(isinstance(c, str) for c in command)
        ):
            raise errors.ConfigError(
                f"{origin}: [[worker]] needs a command (a list of strings)", field="worker.command"
            )
        tenant = item.get("tenant")
        if tenant is not None and (not isinstance(tenant, str) or not tenant):
            raise errors.ConfigError(
                f"{origin}: [[worker]] tenant must be a tenant name or id", field="worker.tenant"
            )
        concurrency = item.get("concurrency", 1)
        if not limits.is_int(concurrency) or not 1 <= concurrency <= MAX_WORKER_CONCURRENCY:
            raise errors.ConfigError(
                f"{origin}: concurrency must be an integer from 1 to {MAX_WORKER_CONCURRENCY}",
                field="worker.concurrency",
            )
        lease = item.get("lease_seconds", 30.0)
        if (
            isinstance(lease, bool)
            or not isinstance(lease, int | float)
            or not MIN_LEASE_SECONDS <= lease <= MAX_LEASE_SECONDS
        ):
            raise errors.ConfigError(
                f"{origin}: lease_seconds must be a number from {MIN_LEASE_SECONDS} to "
                f"{MAX_LEASE_SECONDS}",
                field="worker.lease_seconds",
            )
        env = item.get("env", {})
        if not isinstance(env, dict):
            raise errors.ConfigError(
                f"{origin}: [worker.env] must be a table of strings", field="worker.env"
            )
        env_pairs = command_env(env, "worker.env", origin)
        alert_command = item.get("alert_command", [])
        if isinstance(alert_command, str):
            alert_command = [alert_command]
        if not isinstance(alert_command, list) or not all(
            isinstance(c, str) and c for c in alert_command
        ):
            raise errors.ConfigError(
                f"{origin}: alert_command must be a list of strings",
                field="worker.alert_command",
            )
        output_bytes = item.get("output_bytes", limits.DEFAULT_OUTPUT_BYTES)
        if not limits.is_int(output_bytes) or not 0 <= output_bytes <= limits.MAX_OUTPUT_BYTES:
            raise errors.ConfigError(
                f"{origin}: output_bytes must be an integer from 0 to {limits.MAX_OUTPUT_BYTES}",
                field="worker.output_bytes",
            )
        result.append(
            WorkerConfig(
                queue=queue,
                command=tuple(command),
                concurrency=concurrency,
                lease_seconds=float(lease),
                env=env_pairs,
                tenant=tenant,
                alert_command=tuple(alert_command),
                output_bytes=output_bytes,
            )
        )
    return tuple(result)


def _system_config_present() -> bool:
    """Whether /etc/scheduled/scheduled.toml is there; a path that cannot even be looked at
    (a directory without search permission) is a ConfigError, not "absent": falling back
    to the defaults would quietly use another database than the system's."""
    try:
        DEFAULT_CONFIG_PATH.stat()
    except FileNotFoundError:
        return False
    except NotADirectoryError:
        return False
    except OSError as exc:
        raise errors.ConfigError(
            f"cannot look for the system configuration {DEFAULT_CONFIG_PATH}: {exc.strerror}",
            field="config",
        ) from exc
    return True


def where_looked(config: Config) -> str:
    """Where the configuration and the database URL were looked for, for a message about
    the embedded default database."""
    return (
        f"no --config or $SCHEDULED_CONFIG, no {DEFAULT_CONFIG_PATH}, "
        "no --db or $SCHEDULED_DATABASE_URL"
        if config.config_file is None
        else f"{config.config_file} names no database_url, no --db or $SCHEDULED_DATABASE_URL"
    )


def require_database_choice(config: Config) -> None:
    """Refuse the embedded per-user SQLite file where a system configuration exists but
    names no database: the scheduler's state is elsewhere (or nowhere yet), and a private
    file in someone's home directory would hide that behind an empty job list."""
    if config.database_url_from == "defaults" and config.config_file == str(DEFAULT_CONFIG_PATH):
        raise errors.ConfigError(
            f"{DEFAULT_CONFIG_PATH} sets no database_url: a system configuration must name "
            "its database (a per-user SQLite file is not used in its place); add "
            'database_url = "..." to it, or give --db / $SCHEDULED_DATABASE_URL',
            field="database_url",
        )


def load_config(
    path: str | Path | None = None,
    *,
    overrides: dict[str, Any] | None = None,
    environ: dict[str, str] | None = None,
) -> Config:
    """Defaults, then the file (given, $SCHEDULED_CONFIG, or /etc/scheduled/scheduled.toml if it
    exists), then SCHEDULED_* variables, then `overrides` (flags; None values are ignored)."""
    env = dict(os.environ if environ is None else environ)
    values: dict[str, Any] = {}
    sources = ["defaults"]
    file_path = Path(path) if path else None
    if file_path is None and env.get("SCHEDULED_CONFIG"):
        file_path = Path(env["SCHEDULED_CONFIG"])
    if file_path is None and _system_config_present():
        file_path = DEFAULT_CONFIG_PATH
    if file_path is not None:
        try:
            text = file_path.read_text()
            raw = tomllib.loads(text)
        except UnicodeDecodeError as exc:
            raise errors.ConfigError(f"{file_path} is not UTF-8 text", field="config") from exc
        except OSError as exc:
            raise errors.ConfigError(
                f"cannot read {file_path}: {exc.strerror}", field="config"
            ) from exc
        except tomllib.TOMLDecodeError as exc:
            raise errors.ConfigError(
                f"{file_path} is not valid TOML: {exc}", field="config"
            ) from exc
        origin = str(file_path)
        for key, value in raw.items():
            if key == "worker":
                values["workers"] = _file_workers(value, origin, text)
                continue
            if key == "host":
                values["host"] = _file_host(value, origin, text)
                continue
            if key == "alerts":
                values["alerts"] = _file_alerts(value, origin, text)
                continue
            try:
                if key not in _SCALARS:
                    raise errors.ConfigError(
                        _unknown(key, [*_SCALARS, "worker", "host", "alerts"]), field=key
                    )
                if not _file_type_ok(key, value):
                    expected = _SCALARS[key].__name__
                    raise errors.ConfigError(f"expected {expected}, got {value!r}", field=key)
                values[key] = _check_value(key, _coerce(key, value, origin), origin)
            except errors.ConfigError as exc:
                raise _located(exc, origin, text, key) from exc
        sources.append(str(file_path))
    for key in _SCALARS:
        env_value = env.get(ENV_PREFIX + key.upper())
        if env_value not in (None, ""):
            name = ENV_PREFIX + key.upper()
            values[key] = _check_value(key, _coerce(key, env_value, name), name)
            sources.append(ENV_PREFIX + key.upper())
    for key, value in (overrides or {}).items():
        if value is not None:
            flag = "--" + key.replace("_", "-")
            values[key] = (
                _check_value(key, _coerce(key, value, flag), flag) if key in _SCALARS else value
            )
    database_url_from = "defaults"
    if "database_url" in values:
        database_url_from = str(file_path)
    if env.get(ENV_PREFIX + "DATABASE_URL"):
        database_url_from = ENV_PREFIX + "DATABASE_URL"
    if (overrides or {}).get("database_url") is not None:
        database_url_from = "--db"
    config = replace(
        Config(),
        **values,
        source=", ".join(sources),
        config_file=str(file_path) if file_path is not None else None,
        database_url_from=database_url_from,
    )
    if config.partition_count < 1:
        raise errors.ConfigError("must be at least 1", field="partition_count")
    for key in ("relay_lease_seconds", "http_timeout_seconds"):
        value = getattr(config, key)
        if value is not None and not value > 0:
            raise errors.ConfigError("must be a positive number of seconds", field=key)
    if config.relay_max_in_flight < 1:
        raise errors.ConfigError("must be at least 1", field="relay_max_in_flight")
    return config
