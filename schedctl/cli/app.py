"""Owns the root `schedctl` typer app, its global options and the `main()` entry point.

Command groups live one per module and are registered here with `app.add_typer(...)`; other
distributions add theirs through the `schedctl.plugins` entry points (schedctl-bench:
`schedctl bench`), and without them the CLI shows nothing of theirs.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from importlib.metadata import EntryPoint, entry_points
from typing import Annotated, Any

import typer

from schedctl.cli import (
    alerts,
    apply,
    audit,
    completion,
    cron_cmd,
    db,
    dlq,
    import_crontab,
    job_import,
    jobs,
    logs,
    runs,
    status,
    tenant_allow,
    tenants,
)
from schedctl.cli.common import (
    EXIT_CODES_HELP,
    CliState,
    SchedGroup,
    debug_enabled,
    exit_closed_pipe,
    report_exception,
    stdout_is_devnull,
)
from schedctl.cli.output import OutputFormat, console
from schedctl.cli.version import version_option

PIPE_WIDTH = 250

app = typer.Typer(
    name="schedctl",
    cls=SchedGroup,
    help=(
        "schedctl: operate the scheduled-d job scheduler (jobs, runs, tenants, migrations).\n\n"
        "The database comes from --db, then $SCHEDULED_DATABASE_URL, then the config file, "
        "then the embedded SQLite default (created on first use). With --api URL and "
        "--token, job and runs commands go through a remote scheduled-d API instead.\n\n"
        + EXIT_CODES_HELP
    ),
    no_args_is_help=True,
    # --install-completion and --show-completion (for the shell it runs under) next to
    # `schedctl completion SHELL`; the scripts call `schedctl` back with _SCHEDCTL_COMPLETE
    # set, which is cheap, since --help loads no database
    add_completion=True,
    # errors are reported by SchedGroup as one line; never a rich traceback
    pretty_exceptions_enable=False,
)


def _env_option(flag: str, envvar: str, help: str) -> Any:
    """A global option `flag` that $`envvar` sets when it is not given (help shows both)."""
    return typer.Option(flag, envvar=envvar, help=help, show_envvar=True)


@app.callback()
def root(
    ctx: typer.Context,
    db_url: Annotated[
        str | None,
        _env_option(
            "--db", "SCHEDULED_DATABASE_URL", "Database URL (postgresql://... or sqlite:///path)."
        ),
    ] = None,
    config: Annotated[
        str | None,
        _env_option(
            "--config",
            "SCHEDULED_CONFIG",
            "TOML configuration file (default /etc/scheduled/scheduled.toml if present).",
        ),
    ] = None,
    api: Annotated[
        str | None,
        _env_option(
            "--api",
            "SCHEDULED_API_URL",
            "Work against this scheduled-d API (http://host:port) instead of the "
            "database: job and runs commands only.",
        ),
    ] = None,
    token: Annotated[
        str | None,
        _env_option(
            "--token",
            "SCHEDULED_API_TOKEN",
            "The tenant's API token, with --api (prefer the environment variable).",
        ),
    ] = None,
    output: Annotated[
        OutputFormat,
        typer.Option(
            "--output",
            "-o",
            help="table (for people) or json (for scripts); each command also takes --output.",
            case_sensitive=False,
        ),
    ] = OutputFormat.table,
    debug: Annotated[
        bool, typer.Option("--debug", help="Show tracebacks of internal errors.")
    ] = False,
    version: Annotated[bool, version_option("schedctl")] = False,
) -> None:
    """Global options; nothing is opened until a command needs it."""
    del version
    if not console.is_terminal and not os.environ.get("COLUMNS"):
        # piped or captured: rich would squeeze tables into 80 columns and cut job ids
        # short with an ellipsis; a line per row is what grep and people both want
        console.width = PIPE_WIDTH
    state = CliState(
        db=db_url, config_path=config, output=output, debug=debug, api_url=api, api_token=token
    )
    ctx.obj = state
    ctx.call_on_close(state.close)


app.add_typer(db.app, name="db")
app.add_typer(tenants.app, name="tenant")
app.add_typer(jobs.app, name="job")
app.command("runs")(runs.runs)
app.command("logs")(logs.logs)
app.add_typer(cron_cmd.app, name="cron")
app.command("audit")(audit.audit)
app.command("status")(status.status)
app.add_typer(dlq.app, name="dlq")
app.command("import-crontab")(import_crontab.import_crontab)
app.command("apply")(apply.apply)
# the commands of the groups, each group's in the order its help lists them
for _group, _name, _command in (
    (tenants.app, "allow", tenant_allow.allow),
    (tenants.app, "disallow", tenant_allow.disallow),
    (tenants.app, "delivery", tenant_allow.delivery),
    (tenants.app, "broker", tenant_allow.broker),
    (tenants.app, "alerts", alerts.tenant_alerts),
    (jobs.app, "alerts", alerts.job_alerts),
    (jobs.app, "import", job_import.job_import),
):
    _group.command(_name)(_command)
tenants.app.add_typer(tenant_allow.signing_app, name="signing-secret")
app.command("completion")(completion.completion)

# The entry point group of the distributions that add commands: each entry names a function
# that takes the root app (schedctl-bench's adds the `bench` group).
PLUGIN_GROUP = "schedctl.plugins"


def add_plugins(root: typer.Typer, found: Iterable[EntryPoint] | None = None) -> list[str]:
    """Let each installed plugin (`found`, default: the PLUGIN_GROUP entry points) add its
    commands to `root`; return what went wrong, one line per plugin that could not load."""
    problems: list[str] = []
    for entry in entry_points(group=PLUGIN_GROUP) if found is None else found:
        try:
            entry.load()(root)
        except Exception as exc:  # a broken plugin must not take the product's commands down
            problems.append(f"plugin {entry.name!r} ({entry.value}) not loaded: {exc}")
    return problems


_PLUGIN_PROBLEMS = add_plugins(app)


def main() -> None:
    """The `schedctl` console script."""
    to_devnull = stdout_is_devnull()
    for problem in _PLUGIN_PROBLEMS:
        print(f"warning: {problem}", file=sys.stderr)
    try:
        try:
            app()
        finally:
            # what is still buffered goes out now, where a closed pipe can be handled,
            # rather than at interpreter exit
            if sys.stdout is not None:
                sys.stdout.flush()
    except BrokenPipeError:
        exit_closed_pipe()
    except SystemExit as exc:
        if exc.code == 1 and not to_devnull and stdout_is_devnull():
            exit_closed_pipe()  # help text (typer's own console) met a closed pipe
        raise
    except BaseException as exc:
        # SchedGroup reports errors inside commands; this catches what happens around them
        sys.exit(report_exception(exc, debug=debug_enabled()))


if __name__ == "__main__":
    main()
