"""scheduled-d: the daemon entry point; one process per mode (dispatcher, relay, api, worker,
all)."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from schedctl.cli.version import version_option
from schedctl.core import errors, limits
from schedctl.domain.config import (
    Config,
    HostConfig,
    WorkerConfig,
    command_env,
    load_config,
    require_database_choice,
)
from scheduled_d import logsetup, sdnotify
from scheduled_d.checks import check_bind, check_configuration
from scheduled_d.private_env import keep_environment_private
from scheduled_d.signals import handle_sighup, set_reload_hook

if TYPE_CHECKING:
    from schedctl.storage.db.store import Store

app = typer.Typer(
    help="scheduled-d: the scheduler daemon. Modes: dispatcher, relay, api, worker, all.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
log = logging.getLogger("scheduled_d")

DbOption = Annotated[
    str | None, typer.Option("--db", help="Database URL (default: config, then embedded SQLite).")
]
ConfigOption = Annotated[
    str | None, typer.Option("--config", help="TOML configuration file.", envvar="SCHEDULED_CONFIG")
]


LogFormatOption = Annotated[
    str | None,
    typer.Option(
        "--log-format",
        help="text (journald-friendly under systemd) or json (one object per line). "
        "Env: SCHEDULED_LOG_FORMAT.",
    ),
]


def _setup_logging(config: Config) -> None:
    logsetup.setup(config.log_level, config.log_format)


def _config(
    config_path: str | None,
    db: str | None,
    log_format: str | None = None,
    **overrides: str | None,
) -> Config:
    """The configuration (flag > environment > file > defaults), then the log set up from
    it, and SIGHUP set to re-read it (see _reload)."""
    flags = {"database_url": db, "log_format": log_format, **overrides}
    config = load_config(config_path, overrides=flags)
    _setup_logging(config)
    set_reload_hook(lambda: _reload(config, config_path, flags))
    signal.signal(signal.SIGHUP, handle_sighup)  # from now on (start-up included) not fatal
    sdnotify.init()  # read NOTIFY_SOCKET before any command starts (and hide it from them)
    return config


def _reload(current: Config, config_path: str | None, flags: dict[str, str | None]) -> None:
    """SIGHUP: read the configuration again and apply its log level at once; every other
    change is reported as waiting for a restart. A configuration that does not load now
    changes nothing (the error is logged)."""
    try:
        fresh = load_config(config_path, overrides=flags)
    except errors.ConfigError as error:
        log.error("SIGHUP: configuration not reloaded: %s", error)
        return
    logsetup.set_level(fresh.log_level)
    pending = [
        f.name
        for f in dataclasses.fields(Config)
        if f.name not in ("log_level", "source", "node_name")
        and getattr(fresh, f.name) != getattr(current, f.name)
    ]
    log.warning(
        "SIGHUP: configuration re-read (%s): log level %s%s",
        fresh.source,
        fresh.log_level,
        f"; changed, applied at the next restart: {', '.join(pending)}" if pending else "",
    )


def _preflight(config: Config) -> None:
    """A metrics port that is taken or not HOST:PORT fails the start at once, before any
    component runs (a clear error, exit 2; systemd does not restart on it)."""
    if config.metrics_listen:
        check_bind(config.metrics_listen, "metrics_listen")


def _open_store(config: Config, mode: str, *, upgrade: bool) -> Store:
    # imported here: `worker --api` needs no database and loads no database code
    from schedctl.storage.db.engine import normalize_url, sets_itself_up
    from schedctl.storage.db.store import Store

    require_database_choice(config)
    url = normalize_url(config.database_url)
    # the mode in pg_stat_activity: which backends serve dispatchers, relays or workers
    return Store.open(
        url, upgrade=upgrade or sets_itself_up(url), application_name=f"scheduled-d {mode}"
    )


def _bounded(parse: Callable[..., Any], field: str, low: int, high: int) -> Callable[[Any], Any]:
    """A typer parser= for a bounded number flag (schedctl.core.limits: ASCII digits, in range);
    a bad value is a usage error (exit 2)."""

    def number(value: Any) -> Any:
        try:
            return parse(str(value), field, low, high)
        except errors.ValidationError as exc:
            raise typer.BadParameter(exc.message) from None

    return number


@app.callback()
def _main(
    version: Annotated[bool, version_option("scheduled-d")] = False,
) -> None:
    del version


def _fail(error: errors.SchedError) -> None:
    typer.echo(f"scheduled-d: error: {error}", err=True)
    raise typer.Exit(error.exit_code)


def _serve(
    mode: str,
    run: Callable[[Store, Config], None],
    config_path: str | None,
    db: str | None,
    log_format: str | None,
    *,
    upgrade: bool = False,
    **overrides: str | None,
) -> None:
    """A mode's start: the configuration (with `overrides`), the preflight checks, the store,
    then `run` until it stops; a SchedError on the way is the exit."""
    try:
        config = _config(config_path, db, log_format, **overrides)
        _preflight(config)
        store = _open_store(config, mode, upgrade=upgrade)
        try:
            run(store, config)
        finally:
            # a clean stop (SIGTERM, SIGINT) closes the store: SQLite's WAL is checkpointed
            # into the database file, which then holds every run on its own
            store.close()
    except errors.SchedError as error:
        _fail(error)


@app.command()
def all(  # the mode is named "all"
    db: DbOption = None,
    config_path: ConfigOption = None,
    upgrade: Annotated[bool, typer.Option(help="Migrate the database to head first.")] = False,
    log_format: LogFormatOption = None,
) -> None:
    """Dispatcher + relay + the configured workers in one process (the embedded default)."""
    from scheduled_d.runtime import run_all

    _serve("all", run_all, config_path, db, log_format, upgrade=upgrade)


def _plain_mode(name: str, help_text: str) -> None:
    """Register the mode NAME that takes only the common options and runs
    `scheduled_d.runtime.run_NAME` (dispatcher, relay)."""

    def command(
        db: DbOption = None,
        config_path: ConfigOption = None,
        log_format: LogFormatOption = None,
    ) -> None:
        from scheduled_d import runtime

        _serve(name, getattr(runtime, f"run_{name}"), config_path, db, log_format)

    app.command(name, help=help_text)(command)


_plain_mode("dispatcher", "Own partitions and claim their due runs.")
_plain_mode("relay", "Move claimed runs from the outbox to their targets.")


@app.command()
def api(
    db: DbOption = None,
    config_path: ConfigOption = None,
    listen: Annotated[
        str | None,
        typer.Option(
            "--listen",
            help="HOST:PORT to serve on (default: the config's api_listen, 127.0.0.1:8080).",
        ),
    ] = None,
    log_format: LogFormatOption = None,
) -> None:
    """Serve the tenant REST API (/v1, /healthz, /openapi.json) until SIGTERM."""
    from scheduled_d.runtime import run_api

    # flag > environment > file, like every other setting
    _serve("api", run_api, config_path, db, log_format, api_listen=listen)


@app.command(context_settings={"allow_interspersed_args": False})
def worker(
    queue: Annotated[
        str | None,
        typer.Option(
            "--queue",
            "-q",
            help="The built-in queue to consume. Without one: the host worker (--jobs-dir, "
            "or the configuration's [host] table).",
        ),
    ] = None,
    command: Annotated[
        list[str] | None,
        typer.Argument(
            help="The command to run for each message, after --. Without one: the command "
            "of the configuration's worker table of this queue (no shell involved)."
        ),
    ] = None,
    tenant: Annotated[
        str | None,
        typer.Option(
            "--tenant",
            "-t",
            help="The queue's tenant (name or id); may be left out while only one tenant exists.",
        ),
    ] = None,
    concurrency: Annotated[
        int | None,
        typer.Option(
            help=f"Commands run at once (1-{limits.MAX_WORKER_CONCURRENCY}; default 1).",
            parser=_bounded(limits.parse_int, "concurrency", 1, limits.MAX_WORKER_CONCURRENCY),
        ),
    ] = None,
    lease_seconds: Annotated[
        float | None,
        typer.Option(
            help=f"Visibility timeout ({limits.MIN_LEASE_SECONDS}-{limits.MAX_LEASE_SECONDS} s;"
            " default 30).",
            parser=_bounded(
                limits.parse_number,
                "lease_seconds",
                limits.MIN_LEASE_SECONDS,
                limits.MAX_LEASE_SECONDS,
            ),
        ),
    ] = None,
    max_runs: Annotated[
        int | None,
        typer.Option(
            help="Exit after this many runs (for tests and cron-like use).",
            parser=_bounded(limits.parse_int, "max_runs", 1, limits.MAX_RUNS),
        ),
    ] = None,
    env: Annotated[
        list[str] | None,
        typer.Option(
            "--env",
            metavar="KEY=VALUE",
            help="Add a variable to the command's environment (repeatable). The rest of it "
            "is PATH, LANG, TZ, HOME and the SCHED_* run variables; no SCHEDULED_* variable "
            "of the worker reaches the command.",
        ),
    ] = None,
    api_url: Annotated[
        str | None,
        typer.Option(
            "--api",
            help="Lease through the REST API at URL instead of the database: a tenant worker "
            "with the tenant's token, the host worker with its host token (SCHEDULED_API_TOKEN "
            "or --token-file; default for the host worker: [host] api_url).",
        ),
    ] = None,
    token_file: Annotated[
        Path | None,
        typer.Option(
            "--token-file",
            help="With --api: a file holding the API token (else SCHEDULED_API_TOKEN; the host "
            "worker: [host] token_file).",
        ),
    ] = None,
    jobs_dir: Annotated[
        str | None,
        typer.Option(
            "--jobs-dir",
            help="Host worker: run the jobs of this directory's job files (default: [host] "
            "jobs_dir), from this host's queue and its groups' queues.",
        ),
    ] = None,
    host: Annotated[
        str | None,
        typer.Option("--host", help="Host worker: this host's name (default: [host] name)."),
    ] = None,
    group: Annotated[
        list[str] | None,
        typer.Option("--group", help="Host worker: a host group this host serves (repeatable)."),
    ] = None,
    db: DbOption = None,
    config_path: ConfigOption = None,
    log_format: LogFormatOption = None,
) -> None:
    """Run COMMAND once per message of the tenant's QUEUE (payload JSON on stdin, SCHED_* in
    the environment); without --queue, the host worker: the commands of this host's job
    files, for the runs of its queues."""
    host_flags = jobs_dir is not None or host is not None or bool(group)
    if queue is None or host_flags:
        try:
            if queue is not None:
                raise errors.ConfigError(
                    "--queue and --jobs-dir/--host/--group exclude each other", field="queue"
                )
            if command or env:
                raise errors.ConfigError(
                    "the host worker runs the commands of its job files: no command or "
                    "--env (set them in the job files)",
                    field="command",
                )
            if api_url is not None and db is not None:
                raise errors.ConfigError("--api and --db exclude each other", field="db")
            config = _config(config_path, None if api_url else db, log_format)
            host_config = _host_config(config, jobs_dir, host, group, tenant, concurrency)
            _preflight(config)
            from scheduled_d.host_worker import run_api_host_worker, run_host_worker

            api = api_url or (host_config.api_url if db is None else None)
            if api is not None:
                # the fleet's setup: a host token, no database URL on the host
                if token_file is None and host_config.token_file is not None:
                    token_file = Path(host_config.token_file)
                run_api_host_worker(
                    api,
                    _api_token(token_file),
                    host_config,
                    lease_seconds=lease_seconds or 30.0,
                    max_runs=max_runs,
                )
                return
            if token_file is not None:
                raise errors.ConfigError("--token-file goes with --api", field="token_file")
            store = _open_store(config, "worker", upgrade=False)
            try:
                run_host_worker(
                    store, host_config, lease_seconds=lease_seconds or 30.0, max_runs=max_runs
                )
            finally:
                store.close()
        except errors.SchedError as error:
            _fail(error)
        return
    if api_url is not None:
        try:
            command_vars = _env_flags(env or [])
            if db is not None:
                raise errors.ConfigError("--api and --db exclude each other", field="db")
            if tenant is not None:
                raise errors.ConfigError(
                    "with --api the token names the tenant: leave out --tenant", field="tenant"
                )
            config = _config(config_path, None, log_format)
            spec = _worker_spec(config, queue) if not command else None
            from scheduled_d.worker import run_api_worker

            run_api_worker(
                api_url,
                _api_token(token_file),
                queue,
                command or (spec.command if spec else ()),
                concurrency=concurrency or (spec.concurrency if spec else 1),
                lease_seconds=lease_seconds or (spec.lease_seconds if spec else 30.0),
                max_runs=max_runs,
                env={**dict(spec.env if spec else ()), **command_vars},
                output_bytes=_output_bytes(config, queue),
            )
        except errors.SchedError as error:
            _fail(error)
        return
    if token_file is not None:
        _fail(errors.ConfigError("--token-file goes with --api", field="token_file"))
    from scheduled_d.runtime import run_worker

    try:
        command_vars = _env_flags(env or [])
        config = _config(config_path, db, log_format)
        spec = _worker_spec(config, queue) if not command else None
        _preflight(config)
        store = _open_store(config, "worker", upgrade=False)
        try:
            run_worker(
                store,
                queue,
                command or (spec.command if spec else ()),
                concurrency=concurrency or (spec.concurrency if spec else 1),
                lease_seconds=lease_seconds or (spec.lease_seconds if spec else 30.0),
                max_runs=max_runs,
                tenant=tenant or (spec.tenant if spec else None),
                env={**dict(spec.env if spec else ()), **command_vars},
                alert_command=spec.alert_command if spec else (),
                output_bytes=_output_bytes(config, queue),
            )
        finally:
            store.close()
    except errors.SchedError as error:
        _fail(error)


def _host_config(
    config: Config,
    jobs_dir: str | None,
    host: str | None,
    groups: list[str] | None,
    tenant: str | None,
    concurrency: int | None,
) -> HostConfig:
    """The [host] table with the flags over it; no table and no flag: an error."""
    if config.host is None and jobs_dir is None and host is None and not groups:
        raise errors.ConfigError(
            f"give --queue Q (and a command), or run the host worker: --jobs-dir DIR or a "
            f"[host] table in the configuration ({config.source})",
            field="queue",
        )
    from schedctl.domain.jobfiles.placement import check_host

    base = config.host or HostConfig()
    changes: dict[str, Any] = {}
    if jobs_dir is not None:
        changes["jobs_dir"] = os.path.abspath(jobs_dir)
    if host is not None:
        changes["name"] = check_host(host, "--host")
    if groups:
        for name in groups:
            check_host(name, "--group")  # the same shape as a host name
        changes["groups"] = tuple(dict.fromkeys(groups))
    if tenant is not None:
        changes["tenant"] = tenant
    if concurrency is not None:
        changes["concurrency"] = concurrency
    return dataclasses.replace(base, **changes)


def _worker_spec(config: Config, queue: str) -> WorkerConfig:
    """The [[worker]] table of `queue` (a systemd instance's command, never word-split)."""
    for spec in config.workers:
        if spec.queue == queue:
            return spec
    raise errors.ConfigError(
        f"no command given and no [[worker]] table with queue = {queue!r} in "
        f"{config.source}: give one after --, or add the table",
        field="worker.command",
    )


def _output_bytes(config: Config, queue: str) -> int:
    """output_bytes of the [[worker]] table of `queue` (also when the command is given after
    --), else the default."""
    for spec in config.workers:
        if spec.queue == queue:
            return spec.output_bytes
    return limits.DEFAULT_OUTPUT_BYTES


@app.command("check-config")
def check_config(
    file: Annotated[
        str | None,
        typer.Argument(
            help="The file to check (default: $SCHEDULED_CONFIG, else "
            "/etc/scheduled/scheduled.toml)."
        ),
    ] = None,
    bind: Annotated[
        bool,
        typer.Option(
            "--bind/--no-bind",
            help="Also try to listen on metrics_listen (and api_listen when api_enabled); "
            "--no-bind while the daemon itself holds them.",
        ),
    ] = True,
) -> None:
    """Validate the configuration: every table and key (unknown keys are errors), types,
    ranges, listen addresses, worker commands; exit 2 naming the key, FILE and LINE."""
    try:
        summary = check_configuration(file, bind=bind)
    except errors.SchedError as error:
        _fail(error)
    typer.echo(summary)


def _env_flags(flags: list[str]) -> dict[str, str]:
    """--env KEY=VALUE flags, checked like a [worker.env] table; a later one wins."""
    pairs: dict[str, str] = {}
    for flag in flags:
        key, sep, value = flag.partition("=")
        if not sep:
            raise errors.ConfigError(f"expected KEY=VALUE, got {flag!r}", field="--env")
        pairs[key] = value
    return dict(command_env(pairs, "--env"))


def _api_token(token_file: Path | None) -> str:
    """The tenant's token: --token-file, else SCHEDULED_API_TOKEN. Taken out of the process
    environment, so no command the worker runs can inherit it."""
    from_env = os.environ.pop("SCHEDULED_API_TOKEN", "").strip()
    if token_file is None:
        token = from_env
    else:
        try:
            token = token_file.read_text().strip()
        except OSError as exc:
            raise errors.ConfigError(
                f"cannot read the token file {str(token_file)!r}: {exc.strerror}",
                field="token_file",
            ) from exc
    if not token:
        raise errors.ConfigError(
            "--api needs the tenant's API token: set SCHEDULED_API_TOKEN or pass --token-file",
            field="token",
        )
    return token


def main() -> None:
    # before anything reads a secret: commands must not read the environment it came in
    keep_environment_private()
    app()


if __name__ == "__main__":
    main()
