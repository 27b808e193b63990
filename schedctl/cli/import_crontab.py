"""Owns `schedctl import-crontab`: a crontab file in, a jobs.d file out (or shown with
--dry-run), with every line it could not convert listed with its number and reason."""

from __future__ import annotations

import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer

from schedctl.app import crontab
from schedctl.cli.common import OutputOption, output_format, say
from schedctl.cli.output import OutputFormat, emit_json, err_console
from schedctl.core import errors
from schedctl.domain import jobfiles
from schedctl.scheduling.cron import load_zone

MAX_BYTES = 16 * 1024 * 1024
# below this many lines the conversion is instant and a bar would only flicker
PROGRESS_MIN_LINES = 2000
_FILE_CHARS = re.compile(r"[^A-Za-z0-9._-]+", re.ASCII)
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_ZONE_LINE = re.compile(r"^\s*(?:CRON_TZ|TZ)\s*=", re.MULTILINE)


def import_crontab(
    ctx: typer.Context,
    file: Annotated[
        str, typer.Argument(help="The crontab file (- for standard input, e.g. crontab -l |).")
    ],
    user: Annotated[
        str | None,
        typer.Option(
            "--user",
            "-u",
            help="User the jobs of a user crontab run as (required for a user crontab, "
            "unless the file is cron's spool file of that user: /var/spool/cron/crontabs/NAME).",
        ),
    ] = None,
    host_group: Annotated[
        str | None,
        typer.Option("--host-group", "-g", help="Run the jobs on one host of this group."),
    ] = None,
    tz: Annotated[
        str | None,
        typer.Option(
            "--tz", help="Zone of the schedules (default: CRON_TZ in the file, else this host's)."
        ),
    ] = None,
    out: Annotated[
        Path, typer.Option("--out", help="The jobs.d directory to write to.")
    ] = jobfiles.DEFAULT_DIR,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the file instead of writing it.")
    ] = False,
    system: Annotated[
        bool | None,
        typer.Option(
            "--system/--no-system",
            help="Lines have a user column (default: yes for /etc/crontab and /etc/cron.d/*).",
            show_default=False,
        ),
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing file.")] = False,
    output: OutputOption = None,
) -> None:
    """Convert a crontab into a jobs.d file (apply it with `schedctl apply`). Exits 1 when
    it skipped lines (each listed with its number and reason), after writing the rest."""
    text = _read(file)
    is_system = crontab.is_system_crontab(file) if system is None else system
    if not is_system and user is None:
        user = crontab.spool_user(file) if file != "-" else None
        if user is None:
            # without a user the jobs would run as the worker's own user: root
            raise errors.ValidationError(
                "a user crontab (no user column) needs --user, the user its jobs run as "
                "(else they would run as the worker's own user, root); a file with a user "
                "column is a system crontab: --system",
                field="--user",
            )
    zone = tz or ("UTC" if _ZONE_LINE.search(text) else host_zone())
    with _progress(text.count("\n") + 1) as progress:
        result = crontab.convert(
            text,
            system=is_system,
            user=user,
            host_group=host_group,
            timezone=zone,
            progress=progress,
        )
    source = "standard input" if file == "-" else file
    target = out / _file_name(file)
    content = jobfiles.render(
        result.jobs,
        header=(
            f"Imported by schedctl import-crontab from {source}.\n"
            "Review user, run_on and the alerts, then: schedctl apply"
        ),
        comments=[f"{source} line {line}" for line in result.lines],
    )
    # what is written must load back: a failure here is a bug, never a bad file on disk
    jobfiles.parse_text(content, target)
    if result.jobs and not dry_run:
        _check_names(out, target, result.jobs, force=force)
        _write(target, content, force=force)
    fmt = output_format(ctx, output)
    if fmt is OutputFormat.json:
        emit_json(
            {
                "file": str(target),
                "written": bool(result.jobs) and not dry_run,
                "system": is_system,
                "user": user,
                "timezone": zone,
                "timezones": result.timezones,
                "jobs": [
                    {
                        "name": job["name"],
                        "line": line,
                        "cron": job["cron"],
                        "user": job.get("user"),
                    }
                    for job, line in zip(result.jobs, result.lines, strict=True)
                ],
                "skipped": [skip.as_dict() for skip in result.skipped],
                "warnings": [warning.as_dict() for warning in result.warnings],
                **({"content": content} if dry_run else {}),
            }
        )
    else:
        if dry_run:
            sys.stdout.write(content)
            sys.stdout.flush()
        for skip in result.skipped:
            err_console.print(
                f"skipped line {skip.line}: {skip.reason}: {_shown(skip.text)}",
                markup=False,
                highlight=False,
                soft_wrap=True,
            )
        for warning in result.warnings:
            err_console.print(
                f"warning: line {warning.line}: {warning.reason}: {_shown(warning.text)}",
                markup=False,
                highlight=False,
                soft_wrap=True,
            )
        if not dry_run and result.jobs:
            # the zones the schedules are in, as converted (CRON_TZ / TZ lines, --tz)
            zones = ", ".join(result.timezones)
            say(
                f"wrote {len(result.jobs)} job(s) to {target} "
                f"({len(result.skipped)} line(s) skipped"
                + (f", schedules in {zones})" if zones else ", boot jobs only)")
            )
    if not result.jobs and result.skipped:
        raise errors.ValidationError("no line could be converted", field="crontab")
    if result.skipped:
        raise typer.Exit(1)  # the rest is written; the skipped lines are listed above


def _shown(text: str) -> str:
    """A line as the terminal may show it: control and line-separator characters escaped
    (a VT, an ESC sequence or a NEL cannot redraw the screen or forge a line)."""
    return _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


def host_zone() -> str:
    """This host's IANA zone (/etc/timezone, else the /etc/localtime link), else UTC."""
    candidates = []
    try:
        candidates.append(Path("/etc/timezone").read_text(encoding="utf-8").strip())
    except (OSError, UnicodeDecodeError):
        pass
    try:
        link = os.readlink("/etc/localtime")
        if "zoneinfo/" in link:
            candidates.append(link.split("zoneinfo/", 1)[1])
    except OSError:
        pass
    for name in candidates:
        try:
            load_zone(name)
        except errors.ValidationError:
            continue
        return name
    return "UTC"


def _read(file: str) -> str:
    try:
        if file == "-":
            data = sys.stdin.buffer.read(MAX_BYTES + 1)
        else:
            with open(file, "rb") as handle:
                data = handle.read(MAX_BYTES + 1)
    except OSError as exc:
        raise errors.ValidationError(
            f"cannot read {file}: {exc.strerror or exc}", field="FILE"
        ) from None
    if len(data) > MAX_BYTES:
        raise errors.ValidationError(f"{file} is larger than {MAX_BYTES} bytes", field="FILE")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise errors.ValidationError(f"{file} is not UTF-8 text", field="FILE") from None


def _file_name(file: str) -> str:
    base = "stdin" if file == "-" else Path(file).name
    base = _FILE_CHARS.sub("-", base).strip("-.") or "crontab"
    return "crontab.toml" if base == "crontab" else f"crontab-{base}.toml"


def _check_names(out: Path, target: Path, jobs: list[dict[str, Any]], *, force: bool) -> None:
    """Names are unique across the directory: refuse one an existing file already uses."""
    if target.exists() and not force:
        raise errors.Conflict(f"{target} exists (--force replaces it)", field="--out")
    if not out.is_dir():
        return
    names = {job["name"] for job in jobs}
    for path in sorted(out.glob("*.toml")):
        if path == target or path.name.startswith(".") or not path.is_file():
            continue
        try:
            existing = jobfiles.load_file(path)
        except jobfiles.JobFilesError:
            continue  # its own problems are `schedctl apply`'s to report
        for job in existing.jobs:
            if job.name in names:
                raise errors.Conflict(
                    f"job name {job.name!r} is already used in {path}:{job.line}", field="--out"
                )


def _write(target: Path, content: str, *, force: bool) -> None:
    try:
        target.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        # written whole or not at all: a worker may read the directory at any moment.
        # 0600 from its creation (mkstemp's mode): a crontab's lines may hold secrets
        # (passwords in commands, tokens in variables), and no one but its owner may read
        # them, not even for a moment; the worker (root, or this file's owner) still can
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".import-", suffix=".tmp")
        try:
            os.fchmod(fd, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                handle.write(content)
            if not force and target.exists():
                raise errors.Conflict(f"{target} exists (--force replaces it)", field="--out")
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as exc:
        raise errors.ValidationError(
            f"cannot write {target}: {exc.strerror or exc}", field="--out"
        ) from None


@contextmanager
def _progress(lines: int) -> Iterator[Callable[[int, int], None] | None]:
    """A progress bar on stderr for big files, and only on a terminal."""
    if lines < PROGRESS_MIN_LINES or not err_console.is_terminal:
        yield None
        return
    from rich.progress import Progress

    with Progress(console=err_console, transient=True) as bar:
        task = bar.add_task("converting", total=lines)

        def advance(done: int, total: int) -> None:
            if done % 500 == 0 or done == total:
                bar.update(task, completed=done, total=total)

        yield advance
