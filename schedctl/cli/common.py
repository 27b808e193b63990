"""Owns what every schedctl command shares: the root options' state (database or remote API,
config, output format), opening the store, the actor name, and mapping errors to exit codes.

Exit codes (documented in `schedctl --help`) are the error classes' `exit_code`, listed
with their `exit_meaning` from schedctl.core.errors.

Command groups added later (dlq, status, bench, audit) get all of this for free: errors
are mapped by `SchedGroup`, the root app's group class, around every subcommand; a leaf
command takes `output: OutputOption = None` and calls `output_format(ctx, output)`, and
`cli_state(ctx).scheduler()` for jobs and runs, `.database()` / `.store()` for everything
else.

With `--api URL` (and `--token`), `scheduler()` is a `schedctl.client.ApiClient`: the job
and runs commands work against a remote API with the same methods. Commands that need the
database itself (tenants, db, audit, ...) call `database()`, which refuses --api clearly.
"""

from __future__ import annotations

import getpass
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
from rich.text import Text
from typer.core import TyperGroup

from schedctl.cli.output import OutputFormat, console, emit, err_console
from schedctl.core import errors, limits
from schedctl.domain.config import (
    Config,
    default_database_url,
    load_config,
    require_database_choice,
    where_looked,
)

if TYPE_CHECKING:
    # imported where a command needs them: `schedctl --help` must not load sqlalchemy,
    # alembic, the database drivers, requests or pika (tests/unit/test_cli_imports.py)
    from schedctl.app.service import Scheduler
    from schedctl.clients.client import ApiClient
    from schedctl.domain.models import Page
    from schedctl.storage.db.store import Store

# from the error classes (schedctl.core.errors): a new exit code is documented where it is defined
EXIT_CODES_HELP = (
    "Exit codes: "
    + ", ".join(f"{code} {what}" for code, what in errors.exit_codes().items())
    + ", 141 output pipe closed (as `head` does)."
)

# A reader that went away (`schedctl status -o json | head -1`) ends the command the way
# SIGPIPE ends cat or grep: silently, with the status a shell shows for them (128 + 13).
# Not SIG_DFL for SIGPIPE itself: that would also kill us on a socket the database or the
# API closed, where an error message is owed.
CLOSED_PIPE_EXIT = 141

OutputOption = Annotated[
    OutputFormat | None,
    typer.Option(
        "--output",
        "-o",
        help="table (for people) or json (for scripts); default: the root --output, else table.",
        case_sensitive=False,
        show_default=False,
    ),
]
TenantOption = Annotated[
    str | None,
    typer.Option("--tenant", "-t", help="Tenant name or id (limits the command to its jobs)."),
]


@dataclass
class CliState:
    """The root options; the config and the store are opened lazily, on first use, so that
    `--help` and `cron next` work without a database or a readable config file."""

    db: str | None = None
    config_path: str | None = None
    output: OutputFormat = OutputFormat.table
    debug: bool = False
    api_url: str | None = None
    api_token: str | None = field(default=None, repr=False)
    # the leaf command's words ("tenant", "create"): which commands may make a database
    command: tuple[str, ...] = ()
    _config: Config | None = field(default=None, repr=False)
    _scheduler: Scheduler | None = field(default=None, repr=False)
    _client: ApiClient | None = field(default=None, repr=False)

    def config(self) -> Config:
        if self._config is None:
            self._config = load_config(self.config_path, overrides={"database_url": self.db})
        return self._config

    def database_url(self) -> str:
        from schedctl.storage.db.engine import normalize_url

        self._refuse_api()
        config = self.config()
        url = normalize_url(config.database_url)
        check_database_choice(config, url, self.command)
        return url

    def scheduler(self) -> Scheduler | ApiClient:
        """Jobs and runs: the remote API with --api, else the database."""
        if self.api_url:
            if self._client is None:
                from schedctl.clients.client import ApiClient

                self._client = ApiClient(self.api_url, self.api_token or "")
            return self._client
        return self.database()

    def database(self) -> Scheduler:
        """The database's library API; refused with --api (the command needs the database)."""
        self._refuse_api()
        if self._scheduler is None:
            from schedctl.app.service import Scheduler

            config = self.config()
            check_database_choice(config, config.database_url, self.command)
            self._scheduler = Scheduler(
                open_store(config),
                max_payload_bytes=config.max_payload_bytes,
                alert_policy=config.alert_policy,
                metrics_max_jobs=config.metrics_max_jobs_per_tenant,
            )
        return self._scheduler

    def store(self) -> Store:
        return self.database().store

    def _refuse_api(self) -> None:
        if self.api_url:
            raise errors.ValidationError(
                "this command works on the database directly and cannot go through the API: "
                "drop --api (and SCHEDULED_API_URL) and give --db",
                field="--api",
            )

    def close(self) -> None:
        if self._scheduler is not None:
            self._scheduler.close()
            self._scheduler = None
        if self._client is not None:
            self._client.close()
            self._client = None


# The commands that may make the embedded default database on first use (saying so on
# stderr). Every other command refuses a missing one: an empty database made by a look
# (`job list` printing "No jobs") hides a missing or wrong configuration.
CREATING_COMMANDS = frozenset({("tenant", "create"), ("db", "upgrade"), ("db", "restore")})
_noted: set[str] = set()


def check_database_choice(config: Config, url: str, command: tuple[str, ...] = ()) -> None:
    """Before a database is opened: refuse the per-user default where a system
    configuration names no database; where nothing is configured and the default file is
    not there yet, refuse a command that only looks (a ConfigError naming database_url,
    nothing created), and let one that creates (tenant create, db upgrade) make it, saying
    where on stderr, once. `command`: the subcommand's words ("tenant", "create")."""
    from schedctl.storage.db.engine import database_of, normalize_url

    require_database_choice(config)
    url = normalize_url(url)
    if config.database_url_from != "defaults" or not is_embedded_default(url):
        return
    path = database_of(url) or ""
    try:
        present = os.stat(path).st_size > 0
    except OSError:
        present = False
    if present:
        return
    if command[:2] not in CREATING_COMMANDS:
        raise errors.ConfigError(
            f"no database at {path} ({where_looked(config)}): run `scheduled-d all` or "
            "`schedctl db upgrade` to create one there, or give --db / $SCHEDULED_DATABASE_URL "
            "/ database_url in a configuration file",
            field="database_url",
        )
    if path not in _noted:
        _noted.add(path)
        err_console.print(
            f"note: no configuration found ({where_looked(config)}): creating a new "
            f"database at {path}",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )


def is_embedded_default(url: str) -> bool:
    from schedctl.storage.db.engine import normalize_url

    return normalize_url(url) == normalize_url(default_database_url())


def open_store(config: Config) -> Store:
    """The configured database, checked to be at the current schema. A SQLite database
    sets itself up on first use, as scheduled-d does: a new or empty file gets the schema
    (so `schedctl tenant create demo` works on a fresh machine), and the embedded default
    (a file nobody configured) is also upgraded when it is behind. Any other database is
    migrated only by `schedctl db upgrade`: SchemaOutdated (exit 2) says so."""
    from schedctl.storage.db.engine import (
        check_connection,
        make_engine,
        normalize_url,
        redact,
        sets_itself_up,
    )
    from schedctl.storage.db.migrate import is_empty, schema_check
    from schedctl.storage.db.store import Store

    url = normalize_url(config.database_url)
    store = Store(make_engine(url))
    try:
        check_connection(store.engine)
        check = schema_check(store.engine)
        if not check.usable:
            new = check.current is None and is_empty(store.engine)
            behind = check.state == "behind"
            if sets_itself_up(url) and behind and (new or is_embedded_default(url)):
                from schedctl.storage.db.migrate import upgrade_engine

                upgrade_engine(store.engine)
                store.ensure_settings(config.partition_count)
            else:
                raise errors.SchemaOutdated(check.message(f"the database at {redact(url)}"))
    except BaseException:
        store.close()
        raise
    return store


def cli_state(ctx: typer.Context) -> CliState:
    root = ctx.find_root()
    if not isinstance(root.obj, CliState):
        root.obj = CliState()
    if ctx is not root:  # a leaf command asks: remember which one
        root.obj.command = tuple(ctx.command_path[len(root.command_path) :].split())
    return root.obj


def output_format(ctx: typer.Context, output: OutputFormat | None) -> OutputFormat:
    """The leaf command's --output if given, else the root's."""
    return output if output is not None else cli_state(ctx).output


def actor() -> str:
    """Who the audit log says did it."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        # containers often run as a uid with no passwd entry
        user = str(os.getuid()) if hasattr(os, "getuid") else "unknown"
    return f"cli:{user}"


def debug_enabled(ctx: typer.Context | None = None) -> bool:
    if os.environ.get("SCHEDULED_DEBUG", "").lower() in {"1", "true", "yes"}:
        return True
    if ctx is not None:
        root = ctx.find_root()
        if isinstance(root.obj, CliState):
            return root.obj.debug
        return bool(root.params.get("debug"))
    return False


def say(message: str) -> None:
    """A plain line on stdout: no markup (it may quote user input), never wrapped."""
    console.print(message, markup=False, highlight=False, soft_wrap=True)


def emit_page(
    fmt: OutputFormat,
    page: Page,
    as_dict: Callable[[Any], dict[str, Any]],
    *,
    columns: Sequence[str],
    empty: str,
    title: str | None = None,
    table_rows: Callable[[list[Any]], list[dict[str, Any]]] | None = None,
) -> None:
    """One page of a listing: in JSON `{"items": [as_dict(item)...], "next_cursor"}`; as a
    table, `table_rows(items)` (asked only when the page has items; by default the items
    as_dict) or the line `empty`, then the `--cursor` that continues the listing."""
    if fmt is OutputFormat.json:
        emit({"items": [as_dict(i) for i in page.items], "next_cursor": page.next_cursor}, fmt)
        return
    if page.items:
        items = list(page.items)
        rows = table_rows(items) if table_rows is not None else [as_dict(i) for i in items]
        emit(rows, fmt, columns=columns, title=title)
    else:
        say(empty)
    if page.next_cursor:
        say(f"more: --cursor {page.next_cursor}")


def print_error(message: str) -> None:
    # no markup (messages quote user input, which may contain [brackets]) and no wrapping:
    # one error is one line, whatever the terminal width
    err_console.print(Text(f"error: {message}", style="red"), soft_wrap=True)


def exit_closed_pipe() -> NoReturn:
    """Stdout's reader is gone: end quietly with CLOSED_PIPE_EXIT. Stdout is pointed at
    /dev/null first, so the interpreter's final flush of what is still buffered cannot
    fail again (and print `Exception ignored ... BrokenPipeError`)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass  # stdout is no real file (captured): nothing will flush into a closed pipe
    raise SystemExit(CLOSED_PIPE_EXIT)


def stdout_is_devnull() -> bool:
    """Whether stdout is /dev/null: where rich and typer point it when its pipe closed
    while they printed help text, before they exit 1 on their own."""
    try:
        return os.path.samestat(os.fstat(sys.stdout.fileno()), os.stat(os.devnull))
    except (OSError, ValueError, AttributeError):
        return False


def report_exception(exc: BaseException, *, debug: bool) -> int:
    """Print one readable line for `exc` and return the exit code it maps to."""
    if isinstance(exc, errors.SchedError):
        print_error(exc.message)
        if debug:
            traceback.print_exception(exc, file=sys.stderr)
        return exc.exit_code
    if isinstance(exc, KeyboardInterrupt):
        print_error("interrupted")
        return 130
    first = str(exc).strip().splitlines()
    detail = f"{type(exc).__name__}: {first[0]}" if first else type(exc).__name__
    err_console.print(Text(f"internal error: {detail}", style="red"), soft_wrap=True)
    if debug:
        traceback.print_exception(exc, file=sys.stderr)
    else:
        err_console.print(
            Text("(run with --debug or SCHEDULED_DEBUG=1 for the traceback)", style="dim"),
            soft_wrap=True,
        )
    return 1


def _is_cli_control_flow(exc: BaseException) -> bool:
    """typer/click's own exceptions (exit, abort, usage errors) are theirs to handle."""
    if isinstance(exc, typer.Exit | typer.Abort):
        return True
    module = type(exc).__module__
    return module.startswith(("typer.", "click."))


class SchedGroup(TyperGroup):
    """The root group: runs the root callback and the chosen subcommand, and turns any
    exception into `error: ...` on stderr and its exit code: no traceback reaches a user."""

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except BrokenPipeError:
            exit_closed_pipe()
        except Exception as exc:
            if _is_cli_control_flow(exc):
                raise
            code = report_exception(exc, debug=debug_enabled(ctx))
            raise typer.Exit(code) from None
        except KeyboardInterrupt as exc:
            raise typer.Exit(report_exception(exc, debug=False)) from None


def int_parser(field: str, low: int, high: int) -> Callable[[Any], int]:
    """A typer `parser=` for an integer option or argument: ASCII digits only, within
    [low, high] (schedctl.core.limits); anything else is `error: FIELD: ...`, exit 2. click's own
    int type takes other scripts' digits and any size."""

    def integer(value: Any) -> int:
        if limits.is_int(value):
            return limits.check_int(value, field, low, high)
        return limits.parse_int(value, field, low, high)

    return integer


def number_parser(field: str, low: float, high: float) -> Callable[[Any], float]:
    """A typer `parser=` for a number of seconds: ASCII digits, finite, within [low, high]."""

    def number(value: Any) -> float:
        return limits.parse_number(value, field, low, high)

    return number


def id_parser(field: str) -> Callable[[Any], int]:
    """A typer `parser=` for a database id (1 to 2^63-1)."""

    def integer(value: Any) -> int:
        return limits.parse_id(value, field)

    return integer


def limit_option(noun: str) -> Any:
    """The --limit/-n option of every listing: 1 to limits.MAX_PAGE."""
    return typer.Option(
        "--limit",
        "-n",
        help=f"{noun} per page (1-{limits.MAX_PAGE}).",
        parser=int_parser("limit", 1, limits.MAX_PAGE),
    )


def cursor_option() -> Any:
    return typer.Option("--cursor", help="Continue after a previous page.", parser=cursor_parser)


def cursor_parser(value: Any) -> str:
    checked = limits.check_cursor(value)
    assert checked is not None
    return checked


def require_one(options: dict[str, Any], *, field: str, hint: str = "") -> str:
    """The name of the one option given among `options`; ValidationError otherwise."""
    given = [name for name, value in options.items() if value is not None]
    names = ", ".join(options)
    if not given:
        raise errors.ValidationError(f"give one of {names}{hint}", field=field)
    if len(given) > 1:
        raise errors.ValidationError(
            f"give only one of {names} (got {', '.join(given)})", field=field
        )
    return given[0]
