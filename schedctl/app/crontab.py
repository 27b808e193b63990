"""Owns converting a crontab (a user's, or the system's with its user column) into job
file tables, line by line, with the reason for every line it cannot convert.

Cron's semantics kept: environment lines apply to the entries below them (PATH, HOME,
...: the job's env; SHELL: the shell that runs the line; CRON_TZ / TZ: the zone of the
schedule; MAILTO: the e-mail alert target, empty for none; RANDOM_DELAY (cronie): a
window in minutes); the command is a shell line; `%` starts the command's stdin (further
`%` are newlines, `\\%` is a literal %); @reboot and the macros. Cron never retries a
failed run: every job gets retry.max_attempts = 1, so its alert fires on the first
failure, as cron's mail would; an @reboot job gets no alert (boot runs send none).

Names: from the comment directly above an entry ("# Nightly backup" -> nightly-backup),
else the program's name and a short schedule word (backup-daily, health-5min,
warm-cache-boot), unique in the file (-2, -3, ...). A user crontab's line that looks like
it has a system crontab's user column ("* * * * * root cmd") is converted as cron would
run it, with a warning.
"""

from __future__ import annotations

import pwd
import re
import shlex
import shutil
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any

from schedctl.core import errors
from schedctl.domain import config
from schedctl.domain.jobfiles.load import ACCOUNT, EMAIL, GROUP_NAME
from schedctl.scheduling.cron import CronSchedule, load_zone

MAX_LINES = 100_000
MAX_LINE_LENGTH = 64 * 1024
SYSTEM_PATHS = ("/etc/crontab",)
SYSTEM_DIRS = ("/etc/cron.d",)
SPOOL_DIRS = ("/var/spool/cron/crontabs", "/var/spool/cron")
_ENV = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*(.*?)\s*$", re.ASCII)
# ASCII: cron's fields are split at C's isspace, not at Unicode's separators
_FIVE = re.compile(r"\s*(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)(?:\s+(.*))?$", re.ASCII)
_MACRO = re.compile(r"\s*(@\S+)(?:\s+(.*))?$", re.ASCII)
_USER = re.compile(r"(\S+)(?:\s+(.*))?$", re.DOTALL | re.ASCII)
_NAME_CHARS = re.compile(r"[^A-Za-z0-9._-]+", re.ASCII)
# words before the program that says what a line does (cd /; test -x X || ...; nice ...)
_WRAPPERS = frozenset(
    {"cd", "test", "[", "exec", "nice", "ionice", "nohup", "sudo", "env", "time", "command",
     "if", "then", "!", "{", "(", "&&", "||", ";", "chronic", "flock", "timeout"}
)  # fmt: skip
MACROS = (
    "@reboot",
    "@yearly",
    "@annually",
    "@monthly",
    "@weekly",
    "@daily",
    "@midnight",
    "@hourly",
)


@dataclass(frozen=True)
class LineNote:
    """A crontab line (its number and text) and why it was not converted (skipped) or may
    not mean what it says (a warning)."""

    line: int
    text: str
    reason: str

    def as_dict(self) -> dict[str, Any]:
        return {"line": self.line, "reason": self.reason, "text": self.text}


@dataclass
class Conversion:
    """The job tables (the file's keys, ready for jobfiles.render) and the skipped lines."""

    jobs: list[dict[str, Any]] = field(default_factory=list)
    lines: list[int] = field(default_factory=list)  # the crontab line of each job
    skipped: list[LineNote] = field(default_factory=list)
    # lines converted that may not mean what they say (a user column in a user crontab)
    warnings: list[LineNote] = field(default_factory=list)

    @property
    def timezones(self) -> list[str]:
        """The zones the converted schedules are in (@reboot has none), sorted."""
        return sorted({str(job["timezone"]) for job in self.jobs if "timezone" in job})


@dataclass
class _Env:
    """Environment as of the current line (cron snapshots it for each entry)."""

    timezone: str
    env: dict[str, str] = field(default_factory=dict)
    shell: str | None = None
    mailto: list[str] | None = None
    window_minutes: int | None = None


def is_system_crontab(path: str) -> bool:
    """/etc/crontab and /etc/cron.d/* have a user column."""
    pure = PurePath(path)
    return str(pure) in SYSTEM_PATHS or str(pure.parent) in SYSTEM_DIRS


def spool_user(path: str) -> str | None:
    """The user whose crontab `path` is, when it is a file of cron's spool
    (/var/spool/cron/crontabs/NAME, Debian's; /var/spool/cron/NAME, cronie's), else None."""
    pure = PurePath(path)
    if str(pure.parent) in SPOOL_DIRS and ACCOUNT.fullmatch(pure.name):
        return pure.name
    return None


def convert(
    text: str,
    *,
    system: bool = False,
    user: str | None = None,
    host_group: str | None = None,
    timezone: str = "UTC",
    progress: Callable[[int, int], None] | None = None,
) -> Conversion:
    """Every line of crontab `text`; `system`: lines carry a user column; `user`: the
    user of a user crontab's jobs; `host_group`: run them on one host of that group;
    `timezone`: the zone unless CRON_TZ says otherwise."""
    if user is not None and system:
        raise errors.ValidationError(
            "a system crontab names the user on each line (use --no-system for a user crontab)",
            field="--user",
        )
    if user is not None and not ACCOUNT.fullmatch(user):
        raise errors.ValidationError(f"{user!r} is not a user name", field="--user")
    if host_group is not None and not GROUP_NAME.fullmatch(host_group):
        raise errors.ValidationError(
            f"{host_group!r} must be 1-63 letters, digits and . _ -", field="--host-group"
        )
    load_zone(timezone, "--tz")
    # cron ends a line at "\n" only: str.splitlines would also split at VT, FF, FS, GS,
    # RS, NEL, LS and PS, and make an active entry of what follows one in a comment
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if len(lines) > MAX_LINES:
        raise errors.ValidationError(f"has more than {MAX_LINES} lines", field="crontab")
    result = Conversion()
    state = _Env(timezone)
    names: set[str] = set()
    above: str | None = None  # the comment on the line directly above, if any
    for number, raw in enumerate(lines, 1):
        if progress is not None:
            progress(number, len(lines))
        line = raw.rstrip("\r")
        stripped = line.strip()
        comment, above = above, None
        if stripped.startswith("#"):
            above = stripped.lstrip("#").strip()
            continue
        if not stripped:
            continue
        try:
            if "\0" in line:
                # cron's C strings end at a NUL: whatever it would make of the line, it is
                # not what the line shows
                raise _Skip("contains a NUL byte")
            if len(line) > MAX_LINE_LENGTH:
                raise _Skip(f"is longer than {MAX_LINE_LENGTH} characters")
            env = _ENV.match(line)
            # a schedule's first field is a minute (or @macro), never NAME=
            if env:
                _set(state, env.group(1), _unquote(env.group(2)))
                continue
            job = _entry(line, state, system=system, user=user, host_group=host_group)
        except _Skip as skip:
            result.skipped.append(LineNote(number, stripped.replace("\0", "\\0"), skip.reason))
            continue
        if not system:
            warning = _user_column(job, user)
            if warning is not None:
                result.warnings.append(LineNote(number, stripped, warning))
        job["name"] = _unique(_comment_name(comment) or _base_name(job), names)
        result.jobs.append(job)
        result.lines.append(number)
    return result


# the comments crontab(5) templates put above the first entry: not a description of it
_TEMPLATE = re.compile(r"\bm\s+h\s+dom\s+mon\s+dow\b|minute\s*\(0\s*-\s*59\)", re.I)


def _comment_name(comment: str | None) -> str | None:
    """A name from the comment directly above an entry ("# Nightly backup of /srv" ->
    "nightly-backup-of-srv"): lower case, safe characters only. None for no comment, a
    commented-out entry or variable, or crontab's template lines."""
    if not comment or _TEMPLATE.search(comment) or _ENV.match(comment):
        return None
    five, macro = _FIVE.match(comment), _MACRO.match(comment)
    if macro and macro.group(1).lower() in MACROS:
        return None  # "# @daily old-command": a disabled entry
    if five:
        try:
            CronSchedule.parse(" ".join(five.groups()[:5]), "UTC")
            return None  # "# 0 3 * * * old-command": a disabled entry
        except errors.ValidationError:
            pass
    # accents dropped ("Übersicht" -> "ubersicht"), any other non-ASCII character too
    ascii_text = unicodedata.normalize("NFKD", comment).encode("ascii", "ignore").decode()
    slug = re.sub(r"[^a-z0-9]+", "-", ascii_text.lower(), flags=re.ASCII).strip("-")
    if len(slug) > 40:
        slug = slug[:40].rsplit("-", 1)[0] if "-" in slug[:40] else slug[:40]
    return slug or None


def _user_column(job: dict[str, Any], user: str | None) -> str | None:
    """Why a user crontab's line looks like it has a system crontab's user column
    ("* * * * * root /usr/bin/backup": cron would run a command `root`), else None."""
    words = str(job["shell"]).split(None, 2)
    if len(words) < 2 or not ACCOUNT.fullmatch(words[0]):
        return None
    first, second = words[0], words[1]
    if shutil.which(first) is not None:
        return None  # a command of that name: the line means it
    if not (second.startswith("/") or shutil.which(second) is not None):
        return None
    if first not in ("root", user) and not _is_account(first):
        return None
    return (
        f"looks like a user column ({first!r}) in a user crontab: cron runs the command "
        f"{first!r} here; a file with a user column is a system crontab (--system)"
    )


def _is_account(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


class _Skip(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _unquote(value: str) -> str:
    # cron strips one pair of matching quotes around the value
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        return value[1:-1]
    return value


def _set(state: _Env, name: str, value: str) -> None:
    if name == "MAILTO":
        addresses = [a for a in re.split(r"[,\s]+", value) if a]
        for address in addresses:
            if not EMAIL.fullmatch(address):
                raise _Skip(f"MAILTO: {address!r} is not an e-mail address or mailbox")
        state.mailto = addresses
        return
    if name in ("CRON_TZ", "TZ"):
        try:
            load_zone(value, name)
        except errors.ValidationError as exc:
            raise _Skip(str(exc)) from None
        state.timezone = value
        if name == "CRON_TZ":
            return  # cron's own setting; TZ also reaches the command
    if name == "RANDOM_DELAY":
        if not value.isascii() or not value.isdigit() or not 0 <= int(value[:6]) <= 1440:
            raise _Skip("RANDOM_DELAY must be a number of minutes from 0 to 1440")
        state.window_minutes = int(value)
        return
    if name == "SHELL":
        if not value.startswith("/"):
            raise _Skip(f"SHELL must be an absolute path, got {value!r}")
        state.shell = value
    try:
        config.command_env({name: value}, "env")
    except errors.ConfigError as exc:
        raise _Skip(str(exc)) from None
    state.env[name] = value


def _entry(
    line: str, state: _Env, *, system: bool, user: str | None, host_group: str | None
) -> dict[str, Any]:
    macro = _MACRO.match(line)
    if macro:
        expr = macro.group(1).lower()
        if expr not in MACROS:
            raise _Skip(f"unknown macro {macro.group(1)!r} (known: {', '.join(MACROS)})")
        rest = macro.group(2) or ""
    else:
        five = _FIVE.match(line)
        if five is None:
            raise _Skip("is neither a schedule (5 fields or @macro) nor NAME=value")
        expr = " ".join(five.groups()[:5])
        rest = five.group(6) or ""
    job_user = user
    if system:
        column = _USER.match(rest.strip())
        if column is None:
            raise _Skip("has no user column and no command (system crontab format)")
        job_user, rest = column.group(1), column.group(2) or ""
        if not ACCOUNT.fullmatch(job_user):
            raise _Skip(f"user column {job_user!r} is not a user name")
    command, stdin = split_percent(rest.strip())
    if not command.strip():
        raise _Skip("has no command")
    job: dict[str, Any] = {"cron": expr}
    if expr != "@reboot":
        try:
            CronSchedule.parse(expr, state.timezone)
        except errors.ValidationError as exc:
            raise _Skip(str(exc)) from None
        job["timezone"] = state.timezone
    job["shell"] = command
    if state.shell and state.shell != "/bin/sh":
        job["shell_path"] = state.shell
    if stdin is not None:
        job["stdin"] = stdin
    if job_user:
        job["user"] = job_user
    if state.env:
        job["env"] = dict(state.env)
    # cron never retries: one attempt, and a failure is final (and alerted)
    job["retry"] = {"max_attempts": 1}
    job["overlap"] = "allow"  # cron starts a line again while its last run still runs
    if state.window_minutes:
        job["window"] = f"{state.window_minutes}m"
    if host_group:
        job["run_on"] = f"host-group:{host_group}"
    if state.mailto and expr != "@reboot":
        # a boot job's run is the host worker's, at its start: it has no alerts to send
        job["alert_email"] = list(state.mailto)
    return job


def split_percent(command: str) -> tuple[str, str | None]:
    """Cron's `%`: the command before the first unescaped %, and the rest as stdin text
    (each further % a newline, ending in one; None when there is no %). `\\%` is a %."""
    parts: list[str] = []
    current: list[str] = []
    i = 0
    while i < len(command):
        c = command[i]
        if c == "\\" and command.startswith("%", i + 1):
            current.append("%")
            i += 2
            continue
        if c == "%":
            parts.append("".join(current))
            current = []
        else:
            current.append(c)
        i += 1
    parts.append("".join(current))
    if len(parts) == 1:
        return parts[0], None
    stdin = "\n".join(parts[1:])
    return parts[0], stdin if stdin.endswith("\n") else stdin + "\n"


def _base_name(job: dict[str, Any]) -> str:
    """The program's name and a short schedule word ("backup-daily", "health-5min",
    "warm-cache-boot"); run-parts: the directory it runs ("cron.daily") alone."""
    words = _words(job["shell"])
    program = "job"
    for index, word in enumerate(words):
        if PurePath(word).name == "run-parts":
            # Debian's /etc/crontab: the directory says what the line does, and when
            targets = [w for w in words[index + 1 :] if not w.startswith("-")]
            if targets:
                return _label(PurePath(targets[0].rstrip(";")).name)
    for index, word in enumerate(words):
        if word in _WRAPPERS or word.startswith("-") or _ENV.fullmatch(word):
            continue
        if index > 0 and words[index - 1] == "cd":
            continue
        program = PurePath(word).name or word
        break
    return f"{_label(program)}-{schedule_word(str(job['cron']))}"


def _label(program: str) -> str:
    return _NAME_CHARS.sub("-", program).strip("-._")[:40] or "job"


_MACRO_WORDS = {
    "@reboot": "boot",
    "@hourly": "hourly",
    "@daily": "daily",
    "@midnight": "daily",
    "@weekly": "weekly",
    "@monthly": "monthly",
    "@yearly": "yearly",
    "@annually": "yearly",
}
_STEP = re.compile(r"\*/(\d+)", re.ASCII)


def schedule_word(expr: str) -> str:
    """A short word for how often `expr` fires: "5min", "hourly", "2h", "daily",
    "weekdays", "weekly", "monthly", "yearly", "boot"; "cron" when none says it."""
    lowered = expr.lower()
    if lowered in _MACRO_WORDS:
        return _MACRO_WORDS[lowered]
    fields = expr.split()
    if len(fields) != 5:
        return "cron"
    minute, hour, dom, month, dow = fields

    def fixed(value: str) -> bool:
        return "*" not in value and "/" not in value

    step = _STEP.fullmatch(minute)
    if minute == "*":
        return "1min" if hour == "*" else "cron"
    if step:
        return f"{step.group(1)}min"
    if not fixed(minute):
        return "cron"
    hour_step = _STEP.fullmatch(hour)
    if hour == "*":
        return "hourly"
    if hour_step:
        return f"{hour_step.group(1)}h"
    if not fixed(hour):
        return "cron"
    if dom == "*" and month == "*":
        if dow == "*":
            return "daily"
        if dow.lower() in ("1-5", "mon-fri"):
            return "weekdays"
        return "weekly" if fixed(dow) and "," not in dow and "-" not in dow else "cron"
    if dow != "*" or not fixed(dom):
        return "cron"
    return "monthly" if month == "*" else "yearly" if fixed(month) else "cron"


def _words(command: str) -> list[str]:
    try:
        return shlex.split(command, comments=False, posix=True)
    except ValueError:
        return command.split()


def _unique(name: str, taken: set[str]) -> str:
    # the same line twice: -2, -3, ... in file order (bounded by the line count)
    candidate, counter = name, 1
    while candidate in taken:
        counter += 1
        candidate = f"{name}-{counter}"
    taken.add(candidate)
    return candidate
