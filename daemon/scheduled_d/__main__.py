"""scheduled-d: the daemon entry point; one process per mode (dispatcher, relay, api, worker,
all)."""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from schedctl import errors, limits
from schedctl.config import Config, command_env, load_config

if TYPE_CHECKING:
    from schedctl.storage.store import Store

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


def _setup_logging() -> None:
    level = os.environ.get("SCHEDULED_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(
        level=getattr(logging, level, logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
        stream=sys.stderr,
    )


def _config(config_path: str | None, db: str | None) -> Config:
    return load_config(config_path, overrides={"database_url": db})


def _open_store(config: Config, *, upgrade: bool) -> Store:
    # imported here: `worker --api` needs no database and loads no database code
    from schedctl.storage.engine import normalize_url
    from schedctl.storage.store import Store

    url = normalize_url(config.database_url)
    # the embedded SQLite default sets itself up; a shared Postgres is upgraded on purpose
    return Store.open(url, upgrade=upgrade or url.startswith("sqlite"))


def _run_threads(targets: list[tuple[str, Callable[[], None]]]) -> list[threading.Thread]:
    threads = [threading.Thread(target=fn, name=name, daemon=True) for name, fn in targets]
    for thread in threads:
        thread.start()
    return threads


def _bounded(parse: Callable[..., Any], field: str, low: int, high: int) -> Callable[[Any], Any]:
    """A typer parser= for a bounded number flag (schedctl.limits: ASCII digits, in range);
    a bad value is a usage error (exit 2)."""

    def number(value: Any) -> Any:
        try:
            return parse(str(value), field, low, high)
        except errors.ValidationError as exc:
            raise typer.BadParameter(exc.message) from None

    return number


def _fail(error: errors.SchedError) -> None:
    typer.echo(f"scheduled-d: error: {error}", err=True)
    raise typer.Exit(error.exit_code)


@app.command()
def all(  # the mode is named "all"
    db: DbOption = None,
    config_path: ConfigOption = None,
    upgrade: Annotated[bool, typer.Option(help="Migrate the database to head first.")] = False,
) -> None:
    """Dispatcher + relay + the configured workers in one process (the embedded default)."""
    from scheduled_d.runtime import run_all

    _setup_logging()
    try:
        config = _config(config_path, db)
        store = _open_store(config, upgrade=upgrade)
        run_all(store, config)
    except errors.SchedError as error:
        _fail(error)


@app.command()
def dispatcher(
    db: DbOption = None,
    config_path: ConfigOption = None,
) -> None:
    """Own partitions and claim their due runs."""
    from scheduled_d.runtime import run_dispatcher

    _setup_logging()
    try:
        config = _config(config_path, db)
        store = _open_store(config, upgrade=False)
        run_dispatcher(store, config)
    except errors.SchedError as error:
        _fail(error)


@app.command()
def relay(
    db: DbOption = None,
    config_path: ConfigOption = None,
) -> None:
    """Move claimed runs from the outbox to their targets."""
    from scheduled_d.runtime import run_relay

    _setup_logging()
    try:
        config = _config(config_path, db)
        store = _open_store(config, upgrade=False)
        run_relay(store, config)
    except errors.SchedError as error:
        _fail(error)


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
) -> None:
    """Serve the tenant REST API (/v1, /healthz, /openapi.json) until SIGTERM."""
    from scheduled_d.api import run as run_api

    _setup_logging()
    try:
        # flag > environment > file, like every other setting
        config = load_config(config_path, overrides={"database_url": db, "api_listen": listen})
        store = _open_store(config, upgrade=False)
        run_api(store, config)
    except errors.SchedError as error:
        _fail(error)


@app.command(context_settings={"allow_interspersed_args": False})
def worker(
    queue: Annotated[str, typer.Option("--queue", "-q", help="The built-in queue to consume.")],
    command: Annotated[
        list[str], typer.Argument(help="The command to run for each message, after --.")
    ],
    tenant: Annotated[
        str | None,
        typer.Option(
            "--tenant",
            "-t",
            help="The queue's tenant (name or id); may be left out while only one tenant exists.",
        ),
    ] = None,
    concurrency: Annotated[
        int,
        typer.Option(
            help=f"Commands run at once (1-{limits.MAX_WORKER_CONCURRENCY}).",
            parser=_bounded(limits.parse_int, "concurrency", 1, limits.MAX_WORKER_CONCURRENCY),
        ),
    ] = 1,
    lease_seconds: Annotated[
        float,
        typer.Option(
            help=f"Visibility timeout ({limits.MIN_LEASE_SECONDS}-{limits.MAX_LEASE_SECONDS} s).",
            parser=_bounded(
                limits.parse_number,
                "lease_seconds",
                limits.MIN_LEASE_SECONDS,
                limits.MAX_LEASE_SECONDS,
            ),
        ),
    ] = 30.0,
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
            help="Tenant worker: lease through the REST API at URL with the tenant's token "
            "(SCHEDULED_API_TOKEN or --token-file) instead of the database.",
        ),
    ] = None,
    token_file: Annotated[
        Path | None,
        typer.Option(
            "--token-file",
            help="With --api: a file holding the tenant's API token (else SCHEDULED_API_TOKEN).",
        ),
    ] = None,
    db: DbOption = None,
    config_path: ConfigOption = None,
) -> None:
    """Run COMMAND once per message of the tenant's QUEUE (payload JSON on stdin, SCHED_* in
    the environment)."""
    _setup_logging()
    if api_url is not None:
        try:
            command_vars = _env_flags(env or [])
            if db is not None:
                raise errors.ConfigError("--api and --db exclude each other", field="db")
            if tenant is not None:
                raise errors.ConfigError(
                    "with --api the token names the tenant: leave out --tenant", field="tenant"
                )
            from scheduled_d.worker import run_api_worker

            run_api_worker(
                api_url,
                _api_token(token_file),
                queue,
                command,
                concurrency=concurrency,
                lease_seconds=lease_seconds,
                max_runs=max_runs,
                env=command_vars,
            )
        except errors.SchedError as error:
            _fail(error)
        return
    if token_file is not None:
        _fail(errors.ConfigError("--token-file goes with --api", field="token_file"))
    from scheduled_d.runtime import run_worker

    try:
        command_vars = _env_flags(env or [])
        config = _config(config_path, db)
        store = _open_store(config, upgrade=False)
        try:
            run_worker(
                store,
                queue,
                command,
                concurrency=concurrency,
                lease_seconds=lease_seconds,
                max_runs=max_runs,
                tenant=tenant,
                env=command_vars,
            )
        finally:
            store.close()
    except errors.SchedError as error:
        _fail(error)


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
    app()


if __name__ == "__main__":
    main()
