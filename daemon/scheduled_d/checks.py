"""`scheduled-d check-config` and the start-up checks of listen addresses."""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

from schedctl.core import errors
from schedctl.domain.config import DEFAULT_CONFIG_PATH, Config, load_config, locate, parse_listen


def check_bind(listen: str, field: str) -> None:
    """Listen on `listen` for a moment: a port in use (or an address this machine does not
    have) is a ConfigError naming `field`, not a traceback later."""
    host, port = parse_listen(listen, field, default_host="127.0.0.1")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
            sock.listen(1)
        except OSError as exc:
            raise errors.ConfigError(
                f"cannot listen on {listen}: {exc.strerror or exc}", field=field
            ) from exc
        except UnicodeError as exc:
            raise errors.ConfigError(f"cannot resolve {listen}: {exc}", field=field) from exc


def _config_file(file: str | None) -> Path | None:
    if file:
        return Path(file)
    if os.environ.get("SCHEDULED_CONFIG"):
        return Path(os.environ["SCHEDULED_CONFIG"])
    return DEFAULT_CONFIG_PATH if DEFAULT_CONFIG_PATH.exists() else None


def _at(path: Path | None, text: str, field: str, problem: str, index: int | None = None) -> str:
    """ "FIELD: FILE:LINE: problem", as the configuration's own errors say it."""
    parts = field.split(".")
    line = None
    if path is not None:
        line = locate(text, parts[-1], index) if index is not None else locate(text, parts[0])
    where = f"{path}:{line}" if line else str(path) if path else "environment"
    table = f" (in [[worker]] table {index + 1})" if index is not None else ""
    return f"{field}: {where}: {problem}{table}"


def _command_problem(program: str) -> str | None:
    if "/" in program:
        if not os.path.isfile(program):
            return f"{program}: no such file"
        if not os.access(program, os.X_OK):
            return f"{program}: not executable"
        return None
    if shutil.which(program) is None:
        return f"{program}: not found in PATH ({os.environ.get('PATH', '')})"
    return None


def check_configuration(file: str | None, *, bind: bool = True) -> str:
    """Everything load_config checks (tables, keys, types, ranges, addresses: errors name
    FILE:LINE and the key), then what only this machine can tell: the database URL parses,
    each [[worker]] command exists and is executable, and (with `bind`) the listen
    addresses are free, and (with workers) how their runs would be contained. Returns the
    summary; raises ConfigError."""
    path = _config_file(file)
    config = load_config(path)
    text = ""
    if path is not None:
        try:
            text = path.read_text()
        except OSError:  # pragma: no cover - load_config just read it
            text = ""
    _check_database_url(config, path, text)
    zookeeper = _check_zookeeper(config, path, text)
    for index, spec in enumerate(config.workers):
        problem = _command_problem(spec.command[0])
        if problem:
            error = errors.ConfigError(_at(path, text, "worker.command", problem, index))
            error.field = "worker.command"
            raise error
    if bind:
        listens = [("metrics_listen", config.metrics_listen)]
        if config.api_enabled:
            listens.append(("api_listen", config.api_listen))
        for field, listen in listens:
            if not listen:
                continue
            try:
                check_bind(listen, field)
            except errors.ConfigError as exc:
                problem = str(exc).removeprefix(f"{field}: ")
                hint = " (if scheduled-d itself holds it, check with --no-bind)"
                error = errors.ConfigError(_at(path, text, field, problem + hint))
                error.field = field
                raise error from exc
    jobs = ""
    if config.host is not None:
        # as the host worker loads them (permissions, then every file validated together);
        # a JobFilesError names FILE:LINE and the key of each problem
        from schedctl.domain.jobfiles.host import check_dir

        files = check_dir(config.host.jobs_dir)
        count = sum(len(f.jobs) for f in files)
        jobs = f", [host] {config.host.name}: {len(files)} job file(s), {count} job(s)"
    where = path or "no configuration file (defaults and environment)"
    summary = f"{where}: ok ({len(config.workers)} [[worker]] table(s){jobs}{zookeeper})"
    if config.workers or config.host is not None:
        # where the runs would go: a cgroup each, or the process group only and why
        from scheduled_d.cgroups import describe_probe

        summary += f"\nrun containment: {describe_probe()}"
    return summary


def _check_zookeeper(config: Config, path: Path | None, text: str) -> str:
    """The connection string, the credentials (file readable, one user:password line) and
    the TLS files (they load), as the dispatcher will use them; the summary's ZooKeeper
    part (what protects the connection, never the secret)."""
    # here, as below: every mode imports this module (check_bind), check-config alone
    # needs kazoo and the database layer
    from schedctl.coordination.zkaccess import ZooKeeperAccess
    from schedctl.coordination.zookeeper import check_hosts

    if not config.zookeeper:
        return ""
    try:
        check_hosts(config.zookeeper)
        access = ZooKeeperAccess.from_config(config)
    except errors.ConfigError as exc:
        key = exc.field or "zookeeper"
        problem = str(exc).removeprefix(f"{key}: ")
        error = errors.ConfigError(_at(path, text, key, problem))
        error.field = key
        raise error from exc
    return f", zookeeper {config.zookeeper}: {access.describe()}"


def _check_database_url(config: Config, path: Path | None, text: str) -> None:
    from schedctl.storage.db.engine import is_database_url, normalize_url

    if not is_database_url(normalize_url(config.database_url)):
        raise errors.ConfigError(
            _at(
                path, text, "database_url", "not a database URL (postgresql://... or sqlite:///...)"
            )
        )
