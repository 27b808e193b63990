"""The shipped monitoring (issue 34, item 4): the Prometheus rules pass `promtool check rules`
and their unit tests (`promtool test rules`), and every metric the Grafana dashboard and the
rules read is served on the /metrics of the real daemons (`scheduled-d all` and
`scheduled-d api` on Postgres) once they have run jobs."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from datetime import UTC, datetime
from pathlib import Path

import pytest
import requests
from sqlalchemy import func, select

from schedctl.domain.alerts.model import parse_alerts
from schedctl.domain.models import RetryPolicy, Target, TargetType
from schedctl.storage.db import schema
from schedctl.storage.db.store import Store
from schedctl.storage.records import alerts as alerts_repo
from tests.acceptance.process_support import killed_if_left, stops_on_sigterm, wait_for
from tests.factories import create_job, every, make_tenant, once_at
from tests.services.ports import free_port

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "monitoring" / "prometheus" / "scheduled-rules.yml"
RULE_TESTS = ROOT / "monitoring" / "prometheus" / "scheduled-rules.test.yml"
DASHBOARD = ROOT / "monitoring" / "grafana" / "scheduled.json"
# a metric name as PromQL writes one of ours
METRIC = re.compile(r"\bscheduled_[a-z0-9_]+\b")
# the suffixes a histogram's (and a counter's) samples add to the family's name
SUFFIXES = ("_bucket", "_sum", "_count", "_total", "_created")


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.fail("promtool is missing: `make system-deps` installs Debian's prometheus")
    return found


def test_promtool_checks_the_rules_and_runs_their_unit_tests() -> None:
    checked = subprocess.run(
        [promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=120
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS" in checked.stdout
    tested = subprocess.run(
        [promtool(), "test", "rules", RULE_TESTS.name],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=RULE_TESTS.parent,
    )
    assert tested.returncode == 0, tested.stdout + tested.stderr
    # the scheduler's absence pages, on the scrape job name docs/operations.md documents
    assert 'absent(up{job="scheduled"} == 1)' in rule_expressions()


def rule_expressions() -> list[str]:
    """The `expr:` of each rule (one line, or a folded block below it)."""
    exprs: list[str] = []
    lines = RULES.read_text().splitlines()
    for index, line in enumerate(lines):
        stripped = line.strip()
        if not stripped.startswith("expr:"):
            continue
        rest = stripped.removeprefix("expr:").strip()
        if rest not in (">-", ">", "|", "|-"):
            exprs.append(rest)
            continue
        indent = len(line) - len(line.lstrip())
        block = []
        for following in lines[index + 1 :]:
            if following.strip() and len(following) - len(following.lstrip()) <= indent:
                break
            block.append(following.strip())
        exprs.append(" ".join(block).strip())
    return exprs


def dashboard_expressions() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dashboard["panels"] for t in p["targets"]]


def test_the_expressions_are_found() -> None:
    """The parsers above read every rule and panel (else the next test proves nothing)."""
    assert len(rule_expressions()) == RULES.read_text().count("- alert:") >= 7
    assert len(dashboard_expressions()) >= 12
    names = set(METRIC.findall(" ".join(rule_expressions() + dashboard_expressions())))
    assert {"scheduled_job_runs_total", "scheduled_queue_live_workers"} <= names


def served_names(scrape: str) -> set[str]:
    """Every sample name of a scrape, and each declared family with its sample names (a
    labelled family with no child yet declares its name only)."""
    names: set[str] = set()
    for line in scrape.splitlines():
        if line.startswith("# TYPE "):
            family = line.split()[2]
            base = family.removesuffix("_total")
            names.update({family, *(base + s for s in SUFFIXES)})
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


class Daemons:
    """`scheduled-d all` (dispatcher, relay, a worker of queue q) and `scheduled-d api`,
    each with its /metrics."""

    def __init__(self, tmp_path: Path, db_url: str) -> None:
        self.tmp_path = tmp_path
        self.db_url = db_url
        self.all_metrics, self.api_metrics, self.api_port = free_port(), free_port(), free_port()

    def config(self, name: str, text: str) -> Path:
        path = self.tmp_path / name
        path.write_text(text)
        return path

    def start(self, stack: ExitStack) -> list[tuple[subprocess.Popen[bytes], Path]]:
        all_config = self.config(
            "all.toml",
            "poll_interval_seconds = 0.1\n"
            f'metrics_listen = "127.0.0.1:{self.all_metrics}"\n'
            "[[worker]]\n"
            'queue = "q"\n'
            f"command = {json.dumps(['/bin/sh', '-c', 'cat >/dev/null'])}\n"
            "concurrency = 2\n",
        )
        api_config = self.config(
            "api.toml",
            f'metrics_listen = "127.0.0.1:{self.api_metrics}"\n'
            f'api_listen = "127.0.0.1:{self.api_port}"\n',
        )
        started = []
        for mode, config in (("all", all_config), ("api", api_config)):
            log = self.tmp_path / f"{mode}.log"
            with log.open("a") as out:
                process = subprocess.Popen(
                    [BIN / "scheduled-d", mode, "--db", self.db_url, "--config", config],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, "SCHEDULED_LOG_LEVEL": "INFO"},
                )
            stack.enter_context(killed_if_left(process))
            started.append((process, log))
        return started


@pytest.fixture
def store(pg_url: str) -> Iterator[Store]:
    opened = Store.open(pg_url)
    try:
        yield opened
    finally:
        opened.close()


def scrape(port: int) -> str:
    try:
        return requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    except requests.RequestException:
        return ""


def dead_letters(store: Store) -> int:
    with store.read() as connection:
        count = connection.execute(select(func.count()).select_from(schema.dead_letters))
        return int(count.scalar_one())


def test_every_metric_the_dashboard_and_rules_use_is_served(
    tmp_path: Path, pg_url: str, store: Store
) -> None:
    tenant = make_tenant(store, "acme")
    # a job with its own series, watched by a no_success alert (the last-success gauge)
    tick = create_job(
        store, tenant, dataclasses.replace(every(1, datetime.now(UTC), name="tick"), metrics=True)
    )
    alerts_repo.set_settings(
        store, tenant, tick, parse_alerts({"email": ["a@example.com"], "no_success": "PT1H"})
    )
    # an HTTP job whose one attempt fails (nothing listens there): a failure, a dead letter
    broken = dataclasses.replace(
        once_at(datetime.now(UTC), name="broken"),
        target=Target(TargetType.http, url=f"http://127.0.0.1:{free_port()}/hook"),
        retry=RetryPolicy(max_attempts=1, base_delay_seconds=1, max_delay_seconds=1),
        metrics=True,
    )
    create_job(store, tenant, broken)
    daemons = Daemons(tmp_path, pg_url)
    with ExitStack() as stack:
        started = daemons.start(stack)
        logs = lambda: "\n".join(log.read_text() for _, log in started)  # noqa: E731

        def served() -> bool:
            text = scrape(daemons.all_metrics)
            return (
                'scheduled_job_runs_total{job="tick",outcome="succeeded",tenant="acme"}' in text
                and "scheduled_job_last_success_timestamp_seconds{" in text
                and 'scheduled_run_failures_total{tenant="acme"}' in text
                and dead_letters(store) == 1
                and bool(scrape(daemons.api_metrics))
            )

        assert wait_for(served, poll=0.5), logs()
        scrapes = {"all": scrape(daemons.all_metrics), "api": scrape(daemons.api_metrics)}
        names = set().union(*(served_names(text) for text in scrapes.values()))
        used = set(METRIC.findall(" ".join(rule_expressions() + dashboard_expressions())))
        missing = sorted(used - names)
        assert not missing, f"used by monitoring/ but served by no daemon: {missing}"
        # tenants are labelled by name, never by their hex id
        assert f'tenant="{tenant}"' not in scrapes["all"]
        assert "scheduled_store_up 1.0" in scrapes["all"]
        for process, log in started:
            stops_on_sigterm(process, log)
