"""Owns the description of every configuration key and config/scheduled.toml, which is
generated from it: `make config` (python -m schedctl.domain.config_doc > config/scheduled.toml).

The keys themselves (names, types, defaults, checks) are schedctl.domain.config's; here each one
gets its explanation and example values, grouped as the file shows them. A key added to
schedctl.domain.config without a description here fails the generation (and the test that keeps
the file in step) with a message saying where to add it. Tables ([alerts], [host],
[[worker]]) come after every top-level key: uncommenting a top-level line can never land
it inside a table."""

from __future__ import annotations

import json
import sys
import textwrap
from collections.abc import Callable
from dataclasses import MISSING, dataclass, fields
from typing import Any

from schedctl.domain.alerts.policy import KEYS as ALERT_KEYS
from schedctl.domain.alerts.policy import AlertPolicy
from schedctl.domain.config import (
    _SCALARS,
    DEFAULT_CONFIG_PATH,
    ENV_PREFIX,
    HOST_KEYS,
    WORKER_KEYS,
    Config,
    HostConfig,
    WorkerConfig,
)

REGENERATE = "make config"
WIDTH = 92


@dataclass(frozen=True)
class Key:
    """One key: its description and, where its default does not show well (none, or made
    at run time), the example values shown instead (TOML text)."""

    name: str
    text: str
    examples: tuple[str, ...] = ()


@dataclass(frozen=True)
class Section:
    """Keys shown together under one comment; `table` names the TOML table they are in
    (None: the top level; "[[worker]]" for the array of tables)."""

    text: str
    keys: tuple[Key, ...]
    table: str | None = None


class MissingDescription(Exception):
    """A key of schedctl.domain.config without a description here, or one described here that
    schedctl.domain.config does not know."""


HEADER = f"""\
{DEFAULT_CONFIG_PATH}: read by both schedctl and scheduled-d. Generated from the
configuration schema (schedctl/domain/config.py, config_doc.py) by `{REGENERATE}`: edit
those, not this file.

Precedence: command-line flag > SCHEDULED_<KEY> environment variable > this file >
defaults. Every key below is optional and shown commented with its default or an example.
With no file at all, scheduled-d runs the embedded default (a SQLite file in the user's
data directory, one process owning every partition) and schedctl says so when it creates
that file; where this file exists it must name database_url.

Set in the environment only (never in this file): SCHEDULED_CONFIG (another file than
this one), SCHEDULED_PAYLOAD_KEYS_FILE (a file of payload encryption keys, the current one
first; or the keys themselves in SCHEDULED_PAYLOAD_KEYS), SCHEDULED_ZOOKEEPER_AUTH (the
ZooKeeper user:password line, instead of zookeeper_auth_file), SCHEDULED_API_URL and
SCHEDULED_API_TOKEN (schedctl against a remote API), SCHEDULED_DEBUG (tracebacks of
unexpected errors)."""

SECTIONS: tuple[Section, ...] = (
    Section(
        "Where jobs, runs and the outbox live. On Postgres the daemons use the runtime role "
        "(`schedctl db grant ROLE`: no DDL) and TLS with the server's CA; migrations and "
        "`schedctl db maintain` use the owner's URL instead.",
        (
            Key(
                "database_url",
                "postgresql://USER@HOST:PORT/DB or sqlite:////PATH (default: a SQLite file in "
                "the user's data directory; not used where this file exists and names none). "
                "A primary and a standby (Patroni): list both hosts with "
                "target_session_attrs=read-write, and every connection goes to the writable "
                "one.",
                (
                    '"postgresql://scheduled_runtime@db.internal:5432/scheduled?'
                    'sslmode=verify-full&sslrootcert=/etc/scheduled/db-ca.crt"',
                    '"postgresql://scheduled_runtime@/scheduled?host=db1.internal:5432&'
                    "host=db2.internal:5432&target_session_attrs=read-write&"
                    'sslmode=verify-full&sslrootcert=/etc/scheduled/db-ca.crt"',
                    '"sqlite:////var/lib/scheduled/scheduled.db"',
                ),
            ),
        ),
    ),
    Section(
        "ZooKeeper: several dispatchers share the partitions through it (unset: one "
        "dispatcher, in-process).",
        (
            Key(
                "zookeeper",
                "host:port[,host:port...] of the ensemble.",
                ('"zk1.internal:2281,zk2.internal:2281,zk3.internal:2281"',),
            ),
            Key("zookeeper_root", "The node under which the scheduler keeps its nodes."),
            Key(
                "zookeeper_auth_file",
                "Digest credentials: a file (0600) holding one line user:password (or the "
                "line itself in SCHEDULED_ZOOKEEPER_AUTH, never in this file). Every node "
                'under zookeeper_root is then created with the ACL "this user: ALL": nobody '
                "else can register, take or free partitions. Every dispatcher (and `schedctl "
                "status`) needs the same line.",
                ('"/etc/scheduled/zookeeper-auth"',),
            ),
            Key(
                "zookeeper_tls",
                "TLS to ZooKeeper's secureClientPort; zookeeper_tls = true alone checks "
                "against the public CAs. The server's certificate must name the host above.",
                ("true",),
            ),
            Key(
                "zookeeper_tls_ca",
                "The CA the server's certificate chains to (setting it turns TLS on).",
                ('"/etc/scheduled/zookeeper-ca.pem"',),
            ),
            Key(
                "zookeeper_tls_cert",
                "A client certificate, if the server asks for one (ssl.clientAuth=need).",
                ('"/etc/scheduled/zookeeper-client.pem"',),
            ),
            Key(
                "zookeeper_tls_key",
                "The client certificate's unencrypted key.",
                ('"/etc/scheduled/zookeeper-client.key"',),
            ),
            Key(
                "session_timeout_seconds",
                "ZooKeeper session timeout: a dead dispatcher's partitions move after it.",
            ),
        ),
    ),
    Section(
        "Dispatch.",
        (
            Key(
                "partition_count",
                "Number of dispatch partitions, fixed when the database is first upgraded "
                "(`schedctl db upgrade` records it); up to this many dispatchers share the "
                "work.",
            ),
            Key(
                "node_name",
                "This process's name in the cluster, unique (default: hostname-pid).",
                ('"sched-a"',),
            ),
            Key("claim_batch_size", "How many due runs one claim transaction takes."),
            Key("poll_interval_seconds", "How often an idle dispatcher looks."),
            Key(
                "preload_window_seconds",
                "How far ahead the dispatcher keeps due runs in memory.",
            ),
            Key("max_payload_bytes", "Largest accepted payload, in bytes (the JSON encoding)."),
        ),
    ),
    Section(
        "The relay (HTTP and RabbitMQ delivery). A claimed run is the relay's for "
        "relay_lease_seconds, extended by a heartbeat every third of it while the relay "
        "holds the run; a relay that dies (kill -9) has its runs delivered by another about "
        "one lease later.",
        (
            Key(
                "relay_lease_seconds",
                "Unset: 9, or more when the HTTP deadline needs it.",
                ("9",),
            ),
            Key(
                "http_timeout_seconds",
                "The wall-clock deadline of one HTTP call (connect, send, answer and the body "
                "snippet; default 7, shorter than the lease by a margin).",
                ("7",),
            ),
            Key("relay_max_in_flight", "Caps the deliveries running at once in one relay."),
            Key(
                "http_ca_bundle",
                "HTTPS endpoints are checked against the bundled public CAs; for endpoints "
                "behind a private CA name a PEM file here. It replaces the default bundle: to "
                "trust both, put the public CAs (e.g. /etc/ssl/certs/ca-certificates.crt) and "
                "yours in one file.",
                ('"/etc/scheduled/ca.pem"',),
            ),
        ),
    ),
    Section(
        "E-mail alerts (schedctl tenant alerts / job alerts --email): the SMTP server.",
        (
            Key(
                "smtp_host",
                "Unset: e-mail alerts wait, retried, and the relay logs why.",
                ('"127.0.0.1"',),
            ),
            Key("smtp_port", "The SMTP server's port."),
            Key("smtp_from", "The From address of alert mails.", ('"scheduled@example.com"',)),
            Key("smtp_starttls", "STARTTLS before AUTH and the message."),
            Key(
                "smtp_credentials_file",
                "A file holding one line user:password for AUTH (never the secret itself in "
                "this file).",
                ('"/etc/scheduled/smtp-credentials"',),
            ),
        ),
    ),
    Section(
        "Retention, in days. The dispatchers' maintenance (hourly, as the runtime role: "
        "plain DELETEs) and `schedctl db maintain` remove older rows.",
        (
            Key(
                "retention_days",
                "Days of run history kept (Postgres: `schedctl db maintain`, run as the owner "
                "from scheduled-d-maintain.timer, drops whole day partitions; the daemons "
                "delete older rows).",
            ),
            Key(
                "dead_letter_retention_days",
                "Days a dead letter is kept (by when it was dead-lettered), replayed or not.",
            ),
            Key(
                "alert_retention_days",
                "Days a sent or given-up alert is kept; a pending one stays until it is sent "
                "or given up.",
            ),
            Key("audit_retention_days", "Days an audit log entry is kept."),
        ),
    ),
    Section(
        "Serving: Prometheus metrics and the REST API. Addresses are HOST:PORT, [IPv6]:PORT "
        "or :PORT (every interface).",
        (
            Key(
                "metrics_listen",
                "Serve Prometheus /metrics and /healthz on this address (unset: none).",
                ('"127.0.0.1:9464"',),
            ),
            Key(
                "metrics_max_jobs_per_tenant",
                "Jobs of one tenant that may have `metrics = true` (per-job run counts and "
                "durations on /metrics) at once; 0: none may.",
            ),
            Key("api_enabled", "Run the REST API inside `scheduled-d all`."),
            Key("api_listen", "The REST API's address (`scheduled-d api`, api_enabled)."),
        ),
    ),
    Section(
        "Logging.",
        (
            Key(
                "log_level",
                "DEBUG, INFO, WARNING, ERROR or CRITICAL; re-read on SIGHUP.",
            ),
            Key(
                "log_format",
                "text (journald-friendly under systemd) or json; flag --log-format.",
            ),
        ),
    ),
    Section(
        "The operator's alert policy. With an SMTP server (smtp_host), e-mail alerts go only "
        "to the domains listed here; unset, no e-mail alert is allowed. Checked when a tenant "
        "sets its alerts and again when each alert is sent.",
        (
            Key(
                "email_domains",
                '"example.com"; "*.example.com" for its subdomains; "*" for any domain.',
                ('["example.com"]',),
            ),
            Key(
                "max_per_tenant_per_hour",
                "The webhook and e-mail alerts a tenant may have sent in any hour; past it an "
                'alert is given up "rate limited".',
            ),
        ),
        table="alerts",
    ),
    Section(
        "This host's worker for job files (scheduled-jobs(5)), started by `scheduled-d all` "
        "and by `scheduled-d worker` without --queue; `schedctl apply` reads the same table. "
        "A cron host's worker for job files (scheduled-d-host.service). In the fleet's setup "
        "a cron host holds no database_url: its worker and `schedctl --api URL apply` go "
        "through the REST API with a host token (schedctl tenant token create TENANT --host "
        "NAME --group GROUP), kept in a root-only 0600 file.",
        (
            Key(
                "name",
                "This host's name in queues and central job names (default: uname's node name).",
                ('"web-1"',),
            ),
            Key(
                "groups",
                "Host groups: this host also serves the queue group:NAME of each.",
                ('["web"]',),
            ),
            Key("jobs_dir", "Where the job files are."),
            Key(
                "tenant",
                "Tenant name or id; may be left out while exactly one tenant exists.",
                ('"ops"',),
            ),
            Key("concurrency", "Commands at once, for each queue served."),
            Key("output_bytes", "The end of each run's output kept in the run history."),
            Key(
                "rescan_seconds",
                "How often the job files are checked for changes (SIGHUP checks at once).",
            ),
            Key(
                "api_url",
                "The REST API to lease through with a host token (no database URL on the host).",
                ('"https://api.internal:8080"',),
            ),
            Key(
                "token_file",
                "The file holding that host token (else SCHEDULED_API_TOKEN).",
                ('"/etc/scheduled/host.token"',),
            ),
            Key(
                "state_dir",
                "The worker's state across restarts: boot-runs.json, the @reboot jobs already "
                "run in this boot (a restarted worker does not run them again).",
            ),
            Key("boot_id_file", "The kernel's boot id, which says which boot it is."),
        ),
        table="host",
    ),
    Section(
        "Workers that `scheduled-d all` runs in-process: one table per queue. A queue belongs "
        "to a tenant. The command is the worker's own (never taken from a message); it gets "
        "the payload JSON on stdin and SCHED_JOB_ID, SCHED_SCHEDULED_AT, SCHED_ATTEMPT, "
        "SCHED_IDEMPOTENCY_KEY in its environment. That environment is built, not inherited: "
        "PATH, LANG, TZ and HOME of the daemon (those that are set), the [worker.env] table, "
        "and the SCHED_* variables; no SCHEDULED_* variable (database URL, payload keys, API "
        "token) ever reaches the command, and [worker.env] refuses SCHEDULED_* names.",
        (
            Key(
                "tenant",
                "Tenant name or id; may be left out only while exactly one tenant exists.",
                ('"ops"',),
            ),
            Key("queue", "The queue this worker serves (required).", ('"backups"',)),
            Key(
                "command",
                "The command and its arguments (required).",
                ('["/usr/local/bin/backup.sh"]',),
            ),
            Key("concurrency", "Commands at once."),
            Key(
                "lease_seconds",
                "Visibility timeout: a worker that dies loses its runs after this.",
            ),
            Key(
                "output_bytes",
                "End of stdout and of stderr kept per run (`schedctl logs`), at most 1 MiB.",
            ),
            Key(
                "alert_command",
                "Run with an alert's JSON on stdin for each command alert of this queue's "
                "jobs (none by default).",
                ('["/usr/local/bin/page-oncall"]',),
            ),
            Key(
                "env",
                "[worker.env]: variables added to the command's environment (string values).",
                ('{ BACKUP_DIR = "/srv/backups" }',),
            ),
        ),
        table="[[worker]]",
    ),
)

# the schema's own defaults, per table (dataclass fields named as the keys)
_DEFAULTS: dict[str | None, type] = {
    None: Config,
    "alerts": AlertPolicy,
    "host": HostConfig,
    "[[worker]]": WorkerConfig,
}
# the schema's keys, per table, as schedctl.domain.config and the [alerts] parser know them
_SCHEMA: dict[str | None, tuple[str, ...]] = {
    None: tuple(_SCALARS),
    "alerts": tuple(ALERT_KEYS),
    "host": tuple(HOST_KEYS),
    "[[worker]]": tuple(WORKER_KEYS),
}


def _qualified(table: str | None, key: str) -> str:
    prefix = {None: "", "[[worker]]": "worker."}.get(table, f"{table}.")
    return prefix + key


def check_complete() -> None:
    """MissingDescription naming every key without a description (or described but
    unknown), and what to do."""
    described = {
        _qualified(section.table, key.name) for section in SECTIONS for key in section.keys
    }
    known = {_qualified(table, key) for table, keys in _SCHEMA.items() for key in keys}
    missing, unknown = sorted(known - described), sorted(described - known)
    problems = []
    if missing:
        problems.append(
            f"configuration key(s) without a description: {', '.join(missing)}: add a "
            "Key(name, text) to a Section of SECTIONS in schedctl/domain/config_doc.py (the "
            "[alerts], [host] or [[worker]] section for a table's key)"
        )
    if unknown:
        problems.append(
            f"described but not configuration keys: {', '.join(unknown)}: remove them from "
            "schedctl/domain/config_doc.py"
        )
    if problems:
        raise MissingDescription(f"{'; '.join(problems)}; then run `{REGENERATE}`")


def toml_value(value: Any) -> str:
    """A default as TOML text."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, tuple | list):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    raise TypeError(f"no TOML text for {value!r}")


def _default(table: str | None, name: str) -> Any:
    for each in fields(_DEFAULTS[table]):
        if each.name == name:
            if each.default is not MISSING:
                return each.default
            if each.default_factory is not MISSING:
                return each.default_factory()
    return None


def _values(table: str | None, key: Key) -> tuple[str, ...]:
    if key.examples:
        return key.examples
    value = _default(table, key.name)
    if value is None:
        raise MissingDescription(
            f"{_qualified(table, key.name)} has no default to show: give it examples in "
            "schedctl/domain/config_doc.py"
        )
    return (toml_value(value),)


def _comment(text: str) -> list[str]:
    lines: list[str] = []
    for paragraph in text.split("\n\n"):
        if lines:
            lines.append("#")
        lines.extend(
            textwrap.wrap(
                " ".join(paragraph.split()),
                WIDTH,
                initial_indent="# ",
                subsequent_indent="# ",
                break_on_hyphens=False,
                break_long_words=False,
            )
        )
    return lines


def _key_lines(table: str | None, key: Key) -> list[str]:
    text = key.text
    if table is None:
        text += f" Env: {ENV_PREFIX}{key.name.upper()}."
    lines = _comment(text)
    if table == "[[worker]]" and key.name == "env":
        # a subtable: its header, then one variable per line
        lines.append("# [worker.env]")
        for example in key.examples:
            inner = example.strip().removeprefix("{").removesuffix("}")
            lines.extend(f"# {item.strip()}" for item in inner.split(","))
        return lines
    lines.extend(f"# {key.name} = {value}" for value in _values(table, key))
    return lines


def render() -> str:
    """config/scheduled.toml, from the schema and SECTIONS."""
    check_complete()
    out = _comment(HEADER)
    # top-level keys first, then the tables: uncommenting a line lands it where it says
    ordered = [s for s in SECTIONS if s.table is None] + [s for s in SECTIONS if s.table]
    for section in ordered:
        out.append("")
        out.extend(_comment(section.text))
        if section.table is not None:
            header = section.table if section.table.startswith("[[") else f"[{section.table}]"
            out.append(f"# {header}")
        for key in section.keys:
            out.extend(_key_lines(section.table, key))
    return "\n".join(out) + "\n"


def main(write: Callable[[str], Any] = sys.stdout.write) -> int:
    try:
        write(render())
    except MissingDescription as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
