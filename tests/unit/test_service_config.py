"""The configuration's strict checks (unknown keys with lines, listen addresses, log
settings) and the sd_notify sender, in-process."""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
from pathlib import Path

import pytest

from schedctl.core import errors
from schedctl.domain.alerts.policy import DEFAULT_MAX_PER_TENANT_PER_HOUR
from schedctl.domain.config import load_config, locate, parse_listen
from scheduled_d.logsetup import JournalFormatter, JsonFormatter
from scheduled_d.sdnotify import Notifier


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "scheduled.toml"
    path.write_text(text)
    return path


def test_worker_tables_accept_their_known_keys(tmp_path: Path) -> None:
    config = load_config(
        write(
            tmp_path,
            '[[worker]]\nqueue = "q"\ncommand = ["true"]\nconcurrency = 2\nlease_seconds = 9\n'
            'tenant = "acme"\n[worker.env]\nA = "b"\n',
        ),
        environ={},
    )
    assert [(w.queue, w.concurrency, w.lease_seconds) for w in config.workers] == [("q", 2, 9.0)]


def test_unknown_worker_key_names_table_and_line(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        '[[worker]]\nqueue = "a"\ncommand = ["true"]\n[[worker]]\nqueue = "b"\n'
        'command = ["true"]\nconcurency = 4\n',
    )
    with pytest.raises(errors.ConfigError) as info:
        load_config(path, environ={})
    assert str(info.value) == (
        f"worker.concurency: {path}:7: unknown key (did you mean concurrency?) "
        "(in [[worker]] table 2)"
    )
    assert info.value.field == "worker.concurency"
    assert info.value.exit_code == 2


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('metrics_listen = "localhost"\n', "is not HOST:PORT"),
        ('metrics_listen = "127.0.0.1:99999"\n', "at most 65535"),
        ('api_listen = "::1:80"\n', "IPv6 address goes in brackets"),
        ('log_level = "VERBOSE"\n', "unknown log level 'VERBOSE'"),
        ('log_format = "xml"\n', "unknown log format 'xml'"),
        ("poll_interval_seconds = 0\n", "greater than 0"),
        ('api_enabled = "yes"\n', "expected bool"),
        ("[database]\nurl = 1\n", "unknown key"),
    ],
)
def test_file_errors_name_the_line(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, "# first line\n" + text)
    with pytest.raises(errors.ConfigError) as info:
        load_config(path, environ={})
    assert f": {path}:2: " in str(info.value)
    assert message in str(info.value)


def test_environment_log_settings_are_checked_and_normalised() -> None:
    config = load_config(
        None, environ={"SCHEDULED_LOG_LEVEL": "debug", "SCHEDULED_LOG_FORMAT": "JSON"}
    )
    assert (config.log_level, config.log_format) == ("DEBUG", "json")
    with pytest.raises(errors.ConfigError, match="SCHEDULED_LOG_LEVEL: unknown log level"):
        load_config(None, environ={"SCHEDULED_LOG_LEVEL": "VERBOSE"})


def test_parse_listen_forms() -> None:
    assert parse_listen("127.0.0.1:9464", "k") == ("127.0.0.1", 9464)
    assert parse_listen("[::1]:9464", "k") == ("::1", 9464)
    assert parse_listen(":9464", "k") == ("0.0.0.0", 9464)
    assert parse_listen("localhost:1", "k") == ("localhost", 1)


def test_locate_skips_other_tables() -> None:
    text = 'a = 1\n[[worker]]\nqueue = "x"\n[[worker]]\n\nqueue = "y"\n[worker.env]\nX = "1"\n'
    assert locate(text, "X", 1, "env") == 8
    assert locate(text, "a") == 1
    assert locate(text, "queue") is None  # not a top-level key
    assert locate(text, "queue", 1) == 6
    assert locate(text, "command", 1) == 4  # missing: the table's header


def test_notifier_sends_to_an_abstract_socket_and_hides_the_variables() -> None:
    name = f"sdnotify-unit-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as server:
        server.bind(b"\0" + name.encode())
        server.settimeout(60)
        environ = {"NOTIFY_SOCKET": "@" + name, "WATCHDOG_USEC": "4000000"}
        notifier = Notifier.from_environ(environ)
        assert notifier.watchdog_interval == 2.0
        assert notifier.ready("up")
        assert server.recv(100) == b"READY=1\nSTATUS=up"
        assert notifier.status("two\nlines")
        assert server.recv(100) == b"STATUS=two lines"
        notifier.close()


def test_watchdog_belongs_to_the_pid_it_names() -> None:
    other = {"NOTIFY_SOCKET": "/x", "WATCHDOG_USEC": "1000", "WATCHDOG_PID": "1"}
    assert Notifier.from_environ(other).watchdog_interval is None
    assert Notifier(None).ready() is False  # not under systemd: nothing sent
    assert Notifier(None).start_watchdog(lambda: True, threading.Event()) is None


def test_watchdog_pings_only_while_healthy() -> None:
    name = f"sdnotify-wd-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as server:
        server.bind(b"\0" + name.encode())
        server.settimeout(60)
        healthy = threading.Event()
        healthy.set()
        stop = threading.Event()
        notifier = Notifier("@" + name, watchdog_usec=20_000)
        thread = notifier.start_watchdog(healthy.is_set, stop)
        assert thread is not None
        assert server.recv(100) == b"WATCHDOG=1"
        healthy.clear()
        # after the last ping in flight, the unhealthy status and then nothing more
        while (message := server.recv(100)) == b"WATCHDOG=1":
            pass
        assert message.startswith(b"STATUS=unhealthy")
        stop.set()
        thread.join(60)
        assert not thread.is_alive()
        notifier.close()


def record(level: int, message: str) -> logging.LogRecord:
    return logging.LogRecord("scheduled_d.test", level, __file__, 1, message, None, None)


def test_journal_lines_carry_the_priority_on_every_line() -> None:
    text = JournalFormatter().format(record(logging.WARNING, "one\ntwo"))
    assert text == "<4>WARNING scheduled_d.test: one\n<4>two"


def test_json_lines_have_the_fields_and_extras() -> None:
    entry = record(logging.ERROR, "boom")
    entry.job_id = "j1"
    parsed = json.loads(JsonFormatter().format(entry))
    assert parsed["level"] == "ERROR" and parsed["message"] == "boom" and parsed["job_id"] == "j1"
    assert JsonFormatter(journal=True).format(entry).startswith("<3>{")


def test_smtp_keys_and_a_workers_alert_command(tmp_path: Path) -> None:
    config = load_config(
        write(
            tmp_path,
            'smtp_host = "127.0.0.1"\nsmtp_port = 2525\nsmtp_from = "s@example.com"\n'
            "smtp_starttls = true\n"
            '[[worker]]\nqueue = "q"\ncommand = ["true"]\nalert_command = ["/bin/alert"]\n',
        ),
        environ={},
    )
    assert (config.smtp_host, config.smtp_port, config.smtp_from, config.smtp_starttls) == (
        "127.0.0.1",
        2525,
        "s@example.com",
        True,
    )
    assert config.workers[0].alert_command == ("/bin/alert",)
    bad = write(tmp_path, '[[worker]]\nqueue = "q"\ncommand = ["true"]\nalert_command = 3\n')
    with pytest.raises(errors.ConfigError) as info:
        load_config(bad, environ={})
    assert info.value.field == "worker.alert_command"


def test_the_alerts_table_and_its_mistakes(tmp_path: Path) -> None:
    """[alerts]: recipient domains and the hourly limit per tenant; with an SMTP server and
    no list, no recipient is allowed; each mistake names alerts.KEY and its line."""
    plain = load_config(write(tmp_path, ""), environ={})
    assert plain.alert_policy.max_per_tenant_per_hour == DEFAULT_MAX_PER_TENANT_PER_HOUR
    assert plain.alert_policy.refused_recipients(["a@example.org"]) is None  # no SMTP
    smtp_only = load_config(write(tmp_path, 'smtp_host = "127.0.0.1"\n'), environ={})
    assert "email_domains" in str(smtp_only.alert_policy.refused_recipients(["a@example.com"]))
    config = load_config(
        write(
            tmp_path,
            'smtp_host = "127.0.0.1"\n[alerts]\nemail_domains = ["Example.com", "*.ops.net"]\n'
            "max_per_tenant_per_hour = 5\n",
        ),
        environ={},
    )
    policy = config.alert_policy
    assert (policy.email_domains, policy.max_per_tenant_per_hour) == (
        ("example.com", "*.ops.net"),
        5,
    )
    assert policy.refused_recipients(["a@EXAMPLE.com", "b@x.ops.net"]) is None
    for address in ["a@ops.net", "a@example.com.evil.org", "a@sub.example.com"]:
        assert policy.refused_recipients([address]) is not None, address
    anything = load_config(write(tmp_path, '[alerts]\nemail_domains = ["*"]\n'), environ={})
    assert anything.alert_policy.refused_recipients(["a@anywhere.org"]) is None
    for text, field, line in [
        (
            'retention_days = 9\n[alerts]\nemail_domains = "example.com"\n',
            "alerts.email_domains",
            3,
        ),
        ('[alerts]\nemail_domains = ["exa mple.com"]\n', "alerts.email_domains", 2),
        ("[alerts]\nmax_per_tenant_per_hour = 0\n", "alerts.max_per_tenant_per_hour", 2),
        ("[alerts]\nmax_per_tenant_per_hour = true\n", "alerts.max_per_tenant_per_hour", 2),
        ("[alerts]\nrate = 3\n", "alerts.rate", 2),
        ("alerts = 3\n", "alerts", None),
        ('smtp_from = "s@example.com\\u2028Bcc: x@y.z"\n', "smtp_from", 1),
    ]:
        with pytest.raises(errors.ConfigError) as info:
            load_config(write(tmp_path, text), environ={})
        assert info.value.field == field, text
        if line is not None:
            assert f"scheduled.toml:{line}:" in str(info.value), str(info.value)
