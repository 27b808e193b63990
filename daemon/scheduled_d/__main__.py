"""scheduled-d: the daemon entry point; one process per mode (dispatcher, relay, api, worker,
all)."""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import Annotated, Any

import typer

from schedctl import errors, limits
from schedctl.config import Config, load_config
from schedctl.storage.engine import normalize_url
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
    db: DbOption = None,
    config_path: ConfigOption = None,
) -> None:
    """Run COMMAND once per message of QUEUE (payload JSON on stdin, SCHED_* in the environment)."""
    from scheduled_d.runtime import run_worker

    _setup_logging()
    try:
        config = _config(config_path, db)
        store = _open_store(config, upgrade=False)
        run_worker(
            store,
            queue,
            command,
            concurrency=concurrency,
            lease_seconds=lease_seconds,
            max_runs=max_runs,
        )
    except errors.SchedError as error:
        _fail(error)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
