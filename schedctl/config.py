"""Configuration: one TOML file read by schedctl and scheduled-d; flag > environment > file >
defaults. Secrets are read from files or the environment and never printed."""

from __future__ import annotations

import math
import os
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import platformdirs

from schedctl import errors, limits
from schedctl.limits import MAX_LEASE_SECONDS, MAX_WORKER_CONCURRENCY, MIN_LEASE_SECONDS

DEFAULT_CONFIG_PATH = Path("/etc/scheduled/scheduled.toml")
ENV_PREFIX = "SCHEDULED_"


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
        result.append(
            WorkerConfig(
                queue=queue,
                command=tuple(command),
                concurrency=concurrency,
                lease_seconds=float(lease),
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
    return config
