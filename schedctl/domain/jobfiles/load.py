"""Owns reading and validating job files: every file, table and key is checked before any
job is returned, and each problem names its file, line and key.

The schedule and limits go through the project's own validator (schedctl.domain.jobspec), one
key at a time, so a job file refuses exactly what `schedctl job create` refuses, and one
bad key does not hide the next. Files are validated without a clock: whether an `at`
instant has passed is for whoever applies them.
"""

from __future__ import annotations

import difflib
import errno
import os
import re
import stat
import tomllib
from collections.abc import Mapping
from datetime import UTC, date, datetime, time
from pathlib import Path
from typing import Any

from schedctl.core import errors, limits
from schedctl.domain import config, jobspec
from schedctl.domain.jobfiles.model import (
    DEFAULT_SHELL,
    Alerts,
    FileJob,
    JobFile,
    JobFilesError,
    JobRef,
    Problem,
    RunOn,
    RunOnKind,
)
from schedctl.domain.jobfiles.opening import OpenDir, Refused, open_dir
from schedctl.domain.jobfiles.tomllines import Path as KeyPath
from schedctl.domain.jobfiles.tomllines import key_lines, locate

DEFAULT_DIR = Path("/etc/scheduled/jobs.d")
JOB_KEYS = (
    "name", "description", "enabled",
    "cron", "timezone", "every", "at", "after",
    "command", "shell", "shell_path", "stdin",
    "user", "group", "workdir", "env",
    "timeout", "retry", "misfire_policy", "grace", "window", "max_concurrency",
    "overlap", "memory_max", "cpu_weight", "tasks_max",
    "metrics", "start", "end", "run_on", "output",
    "alert_email", "alert_webhook", "alert_command", "alert_on", "alert_no_success",
)  # fmt: skip
# passed to jobspec as they are (start and end are checked together)
LIMIT_KEYS = (
    "timeout", "retry", "misfire_policy", "grace", "window", "max_concurrency", "metrics",
    "overlap", "memory_max", "cpu_weight", "tasks_max",  # the run policy (runpolicy.py)
)  # fmt: skip
ALERT_EVENTS = ("dead_letter", "failure")
# where a run's output goes: "central" (its tail in the run history, and the daemon's log),
# or "local" (the daemon's log / journal of this host only)
OUTPUT_PLACES = ("central", "local")
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}", re.ASCII)
GROUP_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}", re.ASCII)
# POSIX-portable user and group names (useradd's own rule, plus upper case and dots)
ACCOUNT = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}\$?", re.ASCII)
# cron's MAILTO: a local mailbox ("root") or an address
EMAIL = re.compile(r"[A-Za-z0-9.!#$%&'*+/=?^_`{|}~-]+(?:@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*)?")
MAX_ARGS = 1000
MAX_TEXT = limits.DEFAULT_MAX_PAYLOAD_BYTES
MAX_FILES = 10_000
# jobspec validates a key given the rest of a body; these stand in for the parts it
# requires that a file may lack (a target) or that are checked elsewhere (the schedule)
_TARGET = {"type": "queue", "name": "jobfiles"}
_SCHEDULE = {"every": "1h"}
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
# jobspec's field names for the file's keys
_FIELDS = {"interval": "every", "run_at": "at", "schedule": "cron", "body": "cron"}


class _Refused(Exception):
    def __init__(self, key: KeyPath, message: str) -> None:
        super().__init__(message)
        self.key = key
        self.message = message


def load_dir(directory: str | Path = DEFAULT_DIR, uid: int | None = None) -> list[JobFile]:
    """Every *.toml file of `directory` (hidden files skipped), in name order, each opened
    once and judged as the host's worker judges it (schedctl.domain.jobfiles.opening: a file or
    directory another user owns, or group/other-writable, or a symlinked file, is refused
    with the reason; `uid` is trusted as root is, default this process's effective user),
    validated together: names are unique across files. Raises JobFilesError listing every
    problem."""
    root = Path(directory)
    try:
        opened = open_dir(root, uid)
    except OSError as exc:
        raise JobFilesError([Problem(str(root), None, "jobs_dir", _walk_error(exc))]) from None
    problems: list[Problem] = []
    files: list[JobFile] = []
    with opened:
        names = [n for n in opened.names() if n.endswith(".toml") and not n.startswith(".")]
        if len(names) > MAX_FILES:
            raise JobFilesError(
                [Problem(str(root), None, "jobs_dir", f"holds more than {MAX_FILES} job files")]
            )
        for name in names:
            try:
                read = read_job_file(opened, name, root / name)
            except JobFilesError as exc:
                problems.extend(exc.problems)
                continue
            if read is not None:
                files.append(read[1])
    problems.extend(_duplicates(files))
    if not problems:
        problems.extend(_after_problems(files, root))
    if problems:
        raise JobFilesError(problems)
    return files


def _walk_error(exc: OSError) -> str:
    if exc.errno in (errno.ENOENT, errno.ENOTDIR):
        return "is not a directory"
    return f"cannot be opened: {exc.strerror or exc}"


def read_job_file(opened: OpenDir, name: str, path: Path) -> tuple[os.stat_result, JobFile] | None:
    """The job file `name` of the directory `opened` (named `path` in problems), opened
    once, judged and read from that descriptor, then validated: its fstat and its jobs;
    None for a directory (skipped, as a directory named *.toml is no job file). Raises
    JobFilesError: refused (why it is not trusted), unreadable, or invalid."""
    try:
        if stat.S_ISDIR(opened.lstat(name).st_mode):
            return None
        info, data = opened.read(name)
    except Refused as exc:
        raise JobFilesError([Problem(str(path), None, "file", f"refused: {exc.reason}")]) from None
    except OSError as exc:
        reason = exc.strerror or str(exc)
        invalid = Problem(str(path), None, "file", f"cannot be read: {reason}")
        raise JobFilesError([invalid]) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise JobFilesError([Problem(str(path), None, "file", "is not UTF-8 text")]) from None
    return info, parse_text(text, path)


def load_file(path: str | Path, uid: int | None = None) -> JobFile:
    """One job file, opened once and judged as load_dir does, validated on its own (names
    unique within it)."""
    path = Path(path)
    try:
        opened = open_dir(os.path.dirname(os.path.abspath(path)), uid)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        invalid = Problem(str(path), None, "file", f"cannot be read: {reason}")
        raise JobFilesError([invalid]) from None
    with opened:
        read = read_job_file(opened, path.name, path)
    if read is None:
        raise JobFilesError([Problem(str(path), None, "file", "is not a regular file")])
    return read[1]


def parse_text(text: str, path: str | Path) -> JobFile:
    """Job file content `text` (read from `path`, named in errors), validated."""
    path = Path(path)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        found = re.search(r"at line (\d+)", str(exc))
        line = int(found.group(1)) if found else None
        invalid = Problem(str(path), line, "toml", f"is not valid TOML: {exc}")
        raise JobFilesError([invalid]) from None
    lines = key_lines(text)
    problems: list[Problem] = []

    def problem(key: KeyPath, message: str, job: str | None = None) -> None:
        shown = ".".join(str(k) for k in key if not isinstance(k, int))
        problems.append(Problem(str(path), locate(lines, key), shown, message, job))

    for key in data:
        if key != "job":
            problem((key,), "unknown key: a job file holds only [[job]] tables")
    tables = data.get("job", [])
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        problem(("job",), "must be [[job]] tables")
        tables = []
    jobs: list[FileJob] = []
    for index, table in enumerate(tables):
        name = table.get("name") if isinstance(table.get("name"), str) else None
        refusals: list[_Refused] = []
        job = _job(table, path, locate(lines, ("job", index)) or 1, refusals)
        for refused in refusals:
            problem(("job", index, *refused.key), refused.message, name)
        if job is not None:
            jobs.append(job)
    problems.extend(_duplicates([JobFile(path, tuple(jobs))]))
    if problems:
        raise JobFilesError(problems)
    return JobFile(path, tuple(jobs))


def _duplicates(files: list[JobFile]) -> list[Problem]:
    seen: dict[str, FileJob] = {}
    found = []
    for file in files:
        for job in file.jobs:
            first = seen.setdefault(job.name, job)
            if first is not job:
                found.append(
                    Problem(
                        str(job.path),
                        job.line,
                        "job.name",
                        f"{job.name!r} is already the name of a job in {first.path}:{first.line}"
                        " (names are unique across the directory)",
                        job.name,
                    )
                )
    return found


def _after_problems(files: list[JobFile], root: Path) -> list[Problem]:
    """`after` names jobs of the directory, none of them @reboot, without a cycle."""
    jobs = {job.name: job for file in files for job in file.jobs}
    found: list[Problem] = []

    def refuse(job: FileJob, message: str) -> None:
        found.append(Problem(str(job.path), job.line, "job.after", message, job.name))

    for job in jobs.values():
        for name in job.after:
            upstream = jobs.get(name)
            if upstream is None:
                refuse(job, f"names {name!r}, which is no job of {root}")
            elif upstream.is_boot:
                refuse(job, f"names {name!r}, an @reboot job: it has no runs to follow")
    if found:
        return found
    # a cycle: peel off the jobs whose upstreams are all peeled (Kahn); what is left lies
    # on or behind a cycle, and following `after` from one of those finds it
    waiting = {name: set(job.after) for name, job in jobs.items()}
    ready = [name for name, ups in waiting.items() if not ups]
    downstream: dict[str, list[str]] = {}
    for name, job in jobs.items():
        for up in job.after:
            downstream.setdefault(up, []).append(name)
    while ready:
        done = ready.pop()
        del waiting[done]
        for name in downstream.get(done, ()):
            waiting[name].discard(done)
            if not waiting[name]:
                ready.append(name)
    if waiting:
        name = min(waiting)
        path: list[str] = []
        while name not in path:  # at most len(waiting) steps: each step is a new name
            path.append(name)
            name = min(waiting[name])
        cycle = [*path[path.index(name) :], name]
        refuse(jobs[cycle[0]], "makes a cycle: " + " -> ".join(cycle))
    return found


# -- one [[job]] table -----------------------------------------------------------------


def _job(table: dict[str, Any], path: Path, line: int, out: list[_Refused]) -> FileJob | None:
    """The FileJob, or None with every refusal appended to `out` (key paths under the table)."""

    def check(fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except _Refused as exc:
            out.append(exc)
            return None

    for key in table:
        if key not in JOB_KEYS:
            out.append(_Refused((key,), _unknown(key)))
    name = check(_name, table.get("name"))
    description = check(_text, table, "description", 500)
    enabled = check(_bool, table, "enabled", True)
    after = check(_after, table)
    # a job with `after` has no schedule (a refused `after` is the one problem to name)
    schedule = check(_schedule, table) if "after" not in table else (None,)
    command = check(_command, table)
    shell_path = check(_shell_path, table)
    stdin = check(_text, table, "stdin", MAX_TEXT)
    user = check(_account, table, "user")
    group = check(_account, table, "group")
    workdir = check(_abs_path, table, "workdir")
    env = check(_env, table)
    limits_body = {}
    for key in LIMIT_KEYS:
        if key in table:
            checked = check(_limit, key, table[key])
            if checked is not None:
                limits_body[key] = checked[0]
    bounds = check(_start_end, table)
    if bounds:
        limits_body.update(bounds)
    run_on = check(_run_on, table)
    output = check(_output, table)
    alerts = check(_alerts, table)
    if out:
        return None
    argv, shell = command
    return FileJob(
        name=name,
        path=path,
        line=line,
        schedule=schedule[0],
        command=argv,
        shell=shell,
        shell_path=shell_path,
        stdin=stdin,
        user=user,
        group=group,
        workdir=workdir,
        env=env,
        limits=limits_body,
        run_on=run_on,
        output=output,
        alerts=alerts,
        enabled=enabled,
        description=description,
        after=after,
    )


def _unknown(key: str) -> str:
    close = difflib.get_close_matches(key, JOB_KEYS, n=1)
    return "unknown key" + (f" (did you mean {close[0]}?)" if close else "")


def _name(value: Any) -> str:
    if value is None:
        raise _Refused(("name",), "is required")
    if not isinstance(value, str) or not NAME.fullmatch(value):
        raise _Refused(
            ("name",),
            "must be 1-100 letters, digits and . _ - starting with a letter or digit, "
            f"got {limits.describe(value)}",
        )
    return value


def _text(table: Mapping[str, Any], key: str, most: int) -> str | None:
    value = table.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise _Refused((key,), f"must be a string, got {limits.describe(value)}")
    if len(value.encode("utf-8", "surrogatepass")) > most:
        raise _Refused((key,), f"is longer than {most} bytes")
    return value


def _bool(table: Mapping[str, Any], key: str, default: bool) -> bool:
    value = table.get(key, default)
    if not isinstance(value, bool):
        raise _Refused((key,), f"must be true or false, got {limits.describe(value)}")
    return value


def _jobspec_error(exc: errors.ValidationError, default: str) -> _Refused:
    """jobspec's error, its field turned into the file's key."""
    field = exc.field or default
    message = str(exc)
    if message.startswith(f"{field}: "):
        message = message[len(field) + 2 :]
    parts = field.split(".")
    parts[0] = _FIELDS.get(parts[0], parts[0])
    return _Refused(tuple(parts), message)


def _instant_text(value: Any, key: str) -> Any:
    """A TOML date-time as the ISO text jobspec reads; a local one (no offset) is refused."""
    if isinstance(value, datetime):
        if value.tzinfo is None:
            raise _Refused((key,), "needs a UTC offset (e.g. 2026-10-12T08:00:00Z)")
        return value.isoformat()
    if isinstance(value, date | time):
        raise _Refused((key,), "must be a date and time with a UTC offset")
    return value


def _after(table: Mapping[str, Any]) -> tuple[str, ...]:
    """`after = ["job", ...]`: runs after those jobs of the directory, no schedule of its
    own (as the API's `after`)."""
    if "after" not in table:
        return ()
    kinds = [k for k in ("cron", "every", "at", "timezone") if k in table]
    if kinds:
        raise _Refused(
            ("after",),
            f"a dependent job has no schedule of its own: give {kinds[0]} or after, not both",
        )
    value = table["after"]
    if not isinstance(value, list) or not value:
        raise _Refused(("after",), "must be a non-empty list of job names")
    if len(value) > jobspec.MAX_AFTER:
        raise _Refused(("after",), f"at most {jobspec.MAX_AFTER} upstream jobs")
    names: list[str] = []
    for item in value:
        if not isinstance(item, str) or not NAME.fullmatch(item):
            raise _Refused(
                ("after",), f"each entry is the name of a job, got {limits.describe(item)}"
            )
        if item == table.get("name"):
            raise _Refused(("after",), f"names the job itself ({item!r})")
        if item not in names:
            names.append(item)
    return tuple(names)


def _schedule(table: Mapping[str, Any]) -> tuple[dict[str, Any] | None]:
    kinds = [k for k in ("cron", "every", "at") if k in table]
    if not kinds:
        raise _Refused(("cron",), "the job needs a schedule: cron, every, at (or after)")
    if len(kinds) > 1:
        raise _Refused((kinds[1],), f"give one schedule, not {' and '.join(kinds)}")
    kind = kinds[0]
    cron = table.get("cron")
    if kind == "cron" and isinstance(cron, str) and cron.strip().lower() == "@reboot":
        if "timezone" in table:
            raise _Refused(("timezone",), "has no meaning for an @reboot job")
        return (None,)
    body: dict[str, Any] = {kind if kind != "at" else "run_at": table[kind]}
    if kind == "at":
        body["run_at"] = _instant_text(table["at"], "at")
    if "timezone" in table:
        body["timezone"] = table["timezone"]
    elif kind == "cron":
        body["timezone"] = "UTC"
    try:
        jobspec.parse_schedule(body, _EPOCH)
    except errors.ValidationError as exc:
        raise _jobspec_error(exc, kind) from None
    return (body,)


def _argv(value: Any, key: str) -> tuple[str, ...]:
    if (
        not isinstance(value, list)
        or not value
        or len(value) > MAX_ARGS
        or not all(isinstance(a, str) for a in value)
    ):
        raise _Refused((key,), f"must be a list of 1 to {MAX_ARGS} strings (an argv)")
    if not value[0].strip():
        raise _Refused((key,), "the program (first element) must not be empty")
    if any("\0" in a for a in value):
        raise _Refused((key,), "must not contain NUL characters")
    return tuple(value)


def _command(table: Mapping[str, Any]) -> tuple[tuple[str, ...] | None, str | None]:
    if "command" in table and "shell" in table:
        raise _Refused(("shell",), "give command (an argv list) or shell (a line), not both")
    if "command" in table:
        return _argv(table["command"], "command"), None
    if "shell" in table:
        line = table["shell"]
        if not isinstance(line, str) or not line.strip() or "\0" in line:
            raise _Refused(("shell",), "must be a non-empty shell command line")
        return None, line
    raise _Refused(("command",), "the job needs a command (an argv list) or shell (a line)")


def _shell_path(table: Mapping[str, Any]) -> str:
    if "shell_path" not in table:
        return DEFAULT_SHELL
    if "shell" not in table:
        raise _Refused(("shell_path",), "applies only with shell")
    return _abs_path(table, "shell_path") or DEFAULT_SHELL


def _abs_path(table: Mapping[str, Any], key: str) -> str | None:
    value = table.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value.startswith("/") or "\0" in value:
        raise _Refused((key,), f"must be an absolute path, got {limits.describe(value)}")
    return value


def _account(table: Mapping[str, Any], key: str) -> str | None:
    value = table.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not ACCOUNT.fullmatch(value):
        raise _Refused(
            (key,),
            f"must be a {key} name (letters, digits, _ . -, not starting with a digit or -, "
            f"at most 32), got {limits.describe(value)}",
        )
    return value


def _env(table: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    value = table.get("env", {})
    if not isinstance(value, dict):
        raise _Refused(("env",), 'must be a table of NAME = "value"')
    try:
        return config.command_env(value, "env")
    except errors.ConfigError as exc:
        field = exc.field or "env"
        message = str(exc)
        if message.startswith(f"{field}: "):
            message = message[len(field) + 2 :]
        raise _Refused(tuple(field.split(".", 1)), message) from None


def _limit(key: str, value: Any) -> tuple[Any]:
    """The value as the REST body holds it (in a tuple: None is a value here)."""
    if key == "max_concurrency" and limits.is_int(value) and value == 0:
        value = None  # TOML has no null: 0 is "no limit", as --max-concurrency 0
    try:
        jobspec.parse_job_request(
            {"schedule": _SCHEDULE, "target": _TARGET, key: value}, now=_EPOCH
        )
    except errors.ValidationError as exc:
        raise _jobspec_error(exc, key) from None
    return (value,)


def _start_end(table: Mapping[str, Any]) -> dict[str, Any]:
    body = {k: _instant_text(table[k], k) for k in ("start", "end") if k in table}
    if body:
        try:
            body_ = {"schedule": _SCHEDULE, "target": _TARGET, **body}
            jobspec.parse_job_request(body_, now=_EPOCH)
        except errors.ValidationError as exc:
            raise _jobspec_error(exc, "start") from None
    return body


def _run_on(table: Mapping[str, Any]) -> RunOn:
    value = table.get("run_on", RunOnKind.this_host.value)
    shapes = "'this-host', 'host-group:NAME', 'every-host' or 'every-host:GROUP'"
    if not isinstance(value, str):
        raise _Refused(("run_on",), f"must be {shapes}, got {limits.describe(value)}")
    kind_text, _, group = value.partition(":")
    try:
        kind = RunOnKind(kind_text)
    except ValueError:
        raise _Refused(("run_on",), f"must be {shapes}, got {limits.describe(value)}") from None
    if kind is RunOnKind.this_host and group:
        raise _Refused(("run_on",), f"'this-host' takes no group, got {limits.describe(value)}")
    if kind is RunOnKind.host_group and not group:
        raise _Refused(("run_on",), "'host-group' needs a group: 'host-group:NAME'")
    if group and not GROUP_NAME.fullmatch(group):
        raise _Refused(
            ("run_on",),
            f"group {limits.describe(group)} must be 1-63 letters, digits and . _ - "
            "starting with a letter or digit",
        )
    return RunOn(kind, group or None)


def _output(table: Mapping[str, Any]) -> str:
    value = table.get("output", "central")
    if value not in OUTPUT_PLACES:
        raise _Refused(
            ("output",),
            'must be "central" (the output\'s tail in the run history) or "local" (this host\'s '
            f"daemon log only), got {limits.describe(value)}",
        )
    return str(value)


def _strings(table: Mapping[str, Any], key: str) -> tuple[str, ...]:
    value = table.get(key, [])
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _Refused((key,), "must be a string or a list of strings")
    if len(value) > 100:
        raise _Refused((key,), "holds more than 100 entries")
    return tuple(value)


def _alerts(table: Mapping[str, Any]) -> Alerts:
    email = _strings(table, "alert_email")
    for address in email:
        if not EMAIL.fullmatch(address):
            raise _Refused(
                ("alert_email",),
                f"{limits.describe(address)} is not an e-mail address (user@host, or a "
                "local mailbox name as in cron's MAILTO)",
            )
    webhook = _strings(table, "alert_webhook")
    for url in webhook:
        try:
            jobspec.parse_target({"type": "http", "url": url})
        except errors.ValidationError as exc:
            raise _Refused(("alert_webhook",), str(exc).removeprefix("target.url: ")) from None
    command = _argv(table["alert_command"], "alert_command") if "alert_command" in table else ()
    on = _strings(table, "alert_on") if "alert_on" in table else ("dead_letter",)
    for event in on:
        if event not in ALERT_EVENTS:
            raise _Refused(
                ("alert_on",),
                f"must list events among {', '.join(ALERT_EVENTS)}, got {limits.describe(event)}",
            )
    no_success = None
    if "alert_no_success" in table:
        try:
            # the same duration rules as every other duration (grace is one of them)
            spec = jobspec.parse_job_request(
                {"schedule": _SCHEDULE, "target": _TARGET, "grace": table["alert_no_success"]},
                now=_EPOCH,
            )
        except errors.ValidationError as exc:
            raise _Refused(("alert_no_success",), str(exc).removeprefix("grace: ")) from None
        if spec.grace_seconds <= 0:
            raise _Refused(("alert_no_success",), "must be positive")
        no_success = spec.grace_seconds
    return Alerts(email, webhook, command, tuple(on), no_success)


def resolve(ref: JobRef, directory: str | Path = DEFAULT_DIR) -> FileJob:
    """The job a central reference names, read from this host's own `directory`: the
    reference is not trusted to point anywhere else (a path outside the directory, a
    hidden or non-.toml file is refused), and the job must still be in that file."""
    root = Path(directory)
    path = Path(ref.path)
    if (
        path.parent.resolve() != root.resolve()
        or path.suffix != ".toml"
        or path.name.startswith(".")
        or not NAME.fullmatch(ref.name)
    ):
        raise errors.NotFound(
            f"{ref.path} is not a job file of {root} (references are never followed elsewhere)",
            field="job_file",
        )
    for job in load_file(path).jobs:
        if job.name == ref.name:
            return job
    raise errors.NotFound(f"no job {ref.name!r} in {path} (any more)", field="job")
