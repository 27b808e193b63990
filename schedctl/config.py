"""Configuration: one TOML file read by schedctl and scheduled-d; flag > environment > file >
defaults. Secrets are read from files or the environment and never printed."""

from __future__ import annotations

import math
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import platformdirs

from schedctl import errors, limits
from schedctl.limits import MAX_LEASE_SECONDS, MAX_WORKER_CONCURRENCY, MIN_LEASE_SECONDS

DEFAULT_CONFIG_PATH = Path("/etc/scheduled/scheduled.toml")
ENV_PREFIX = "SCHEDULED_"
# A command's environment: what a worker adds to it must be a valid name, never one of the
# worker's own SCHEDULED_* settings (database URL, keys, token) and never a run variable.
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
RUN_VARIABLES = frozenset(
    {"SCHED_JOB_ID", "SCHED_SCHEDULED_AT", "SCHED_ATTEMPT", "SCHED_IDEMPOTENCY_KEY"}
)


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


@dataclass(frozen=True)
class Config:
    database_url: str = field(default_factory=default_database_url)
    zookeeper: str | None = None  # "host:port,host:port"; None: in-process coordinator
    zookeeper_root: str = "/scheduled"
    session_timeout_seconds: float = 10.0
    partition_count: int = 1024
    node_name: str = field(default_factory=lambda: f"{os.uname().nodename}-{os.getpid()}")
    claim_batch_size: int = 5000
    poll_interval_seconds: float = 0.25
    preload_window_seconds: float = 60.0
    max_payload_bytes: int = 64 * 1024
    retention_days: int = 90
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
    workers: tuple[WorkerConfig, ...] = ()
    source: str = "defaults"  # where the config came from, for `schedctl status`


_SCALARS: dict[str, type] = {
    "database_url": str,
    "zookeeper": str,
    "zookeeper_root": str,
    "session_timeout_seconds": float,
    "partition_count": int,
    "node_name": str,
    "claim_batch_size": int,
    "poll_interval_seconds": float,
    "preload_window_seconds": float,
    "max_payload_bytes": int,
    "retention_days": int,
    "metrics_listen": str,
    "api_listen": str,
    "api_enabled": bool,
    "relay_lease_seconds": float,
    "http_timeout_seconds": float,
    "relay_max_in_flight": int,
    "http_ca_bundle": str,
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
        result.append(
            WorkerConfig(
                queue=queue,
                command=tuple(command),
                concurrency=concurrency,
                lease_seconds=float(lease),
                env=env_pairs,
                tenant=tenant,
            )
        )
    return tuple(result)


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
    if file_path is None and DEFAULT_CONFIG_PATH.exists():
        file_path = DEFAULT_CONFIG_PATH
    if file_path is not None:
        try:
            raw = tomllib.loads(file_path.read_text())
        except OSError as exc:
            raise errors.ConfigError(
                f"cannot read {file_path}: {exc.strerror}", field="config"
            ) from exc
        except tomllib.TOMLDecodeError as exc:
            raise errors.ConfigError(
                f"{file_path} is not valid TOML: {exc}", field="config"
            ) from exc
        for key, value in raw.items():
            if key == "worker":
                values["workers"] = _workers(value, str(file_path))
            elif key in _SCALARS:
                values[key] = _coerce(key, value, str(file_path))
            else:
                raise errors.ConfigError(f"{file_path}: unknown setting", field=key)
        sources.append(str(file_path))
    for key in _SCALARS:
        env_value = env.get(ENV_PREFIX + key.upper())
        if env_value not in (None, ""):
            values[key] = _coerce(key, env_value, ENV_PREFIX + key.upper())
            sources.append(ENV_PREFIX + key.upper())
    for key, value in (overrides or {}).items():
        if value is not None:
            values[key] = (
                _coerce(key, value, "--" + key.replace("_", "-")) if key in _SCALARS else value
            )
    config = replace(Config(), **values, source=", ".join(sources))
    if config.partition_count < 1:
        raise errors.ConfigError("must be at least 1", field="partition_count")
    for key in ("relay_lease_seconds", "http_timeout_seconds"):
        value = getattr(config, key)
        if value is not None and not value > 0:
            raise errors.ConfigError("must be a positive number of seconds", field=key)
    if config.relay_max_in_flight < 1:
        raise errors.ConfigError("must be at least 1", field="relay_max_in_flight")
    return config
