"""Owns the rolling-upgrade load test: this release's daemons keep claiming, relaying and
settling while `db upgrade` applies the next release's (synthetic) additive migration
online, keep working against that schema (one restarts on it, as an old host does during a
rolling upgrade), and while `db downgrade` takes it back out.

The synthetic next migration is a real alembic migration in a temporary copy of the
versions directory (`schedctl.storage.db.migrate.MIGRATIONS` points there for this test
process only; the daemons are `scheduled-d` processes of this release and never see it): a
new table, a nullable column on `jobs` (the table every claim updates), and an index built
CONCURRENTLY on `queue_messages` (the table every lease updates). It declares
`compatible_with` = this release's head, as an additive migration does.

Proven: nothing lost and nothing claimed twice (the chaos invariant checker over every run),
no ERROR line and no traceback in any daemon's log, no daemon exited by itself, and the
restarted dispatcher started against the newer schema. Measured and printed, never asserted:
each migration step's time and attempts (a step is one transaction, so its time bounds every
lock it held; CONCURRENTLY steps hold none that blocks writes), every lock wait longer than
LOCK_WAIT_LOG_MS of any session of the database (Postgres's log_lock_waits, checked first to
see a probe wait) and the claim lateness.
"""

from __future__ import annotations

import re
import shutil
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import inspect, text
from sqlalchemy.engine import make_url

from schedctl.storage.db import migrate
from schedctl.storage.db.engine import make_engine
from schedctl_bench.consumers import worker_accepts_tenant
from tests.chaos.checker import check, load_history
from tests.chaos.cluster import Cluster, wait_until
from tests.chaos.conftest import PARTITIONS, SESSION_TIMEOUT_SECONDS
from tests.chaos.test_chaos import Figures, lateness, pending, runs_count
from tests.chaos.test_quorum_loss import CONSUMED_QUEUE, create_load
from tests.services.postgres import PostgresServer
from tests.services.zookeeper import ZooKeeperEnsemble

NEXT = "9001"
DISPATCHERS = ["d1", "d2"]
WARMUP_SECONDS = 6.0
BETWEEN_SECONDS = 6.0
WAIT_SECONDS = 60.0
SETTLE_SECONDS = 90.0
LOCK_WAIT_LOG_MS = 100  # deadlock_timeout: every lock wait longer than this is logged
_LOCK_WAIT = re.compile(r"(still waiting for|acquired) (\w+) on (.*?) after ([0-9.]+) ms")

SYNTHETIC = '''
"""A next release's additive migration (synthetic, tests only).

Revision ID: {next}
Revises: {head}
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "{next}"
down_revision = "{head}"
branch_labels = None
depends_on = None
compatible_with = "{head}"


def upgrade() -> None:
    op.create_table(
        "release_notes",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("job_id", sa.String(40), nullable=False),
        sa.Column("note", sa.Text, nullable=True),
    )
    op.add_column("jobs", sa.Column("release_note", sa.Text, nullable=True))
    if op.get_bind().dialect.name == "postgresql":
        with op.get_context().autocommit_block():
            op.create_index(
                "ix_queue_messages_created",
                "queue_messages",
                ["created_at"],
                postgresql_concurrently=True,
            )


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        with op.get_context().autocommit_block():
            op.drop_index(
                "ix_queue_messages_created",
                table_name="queue_messages",
                postgresql_concurrently=True,
            )
    op.drop_column("jobs", "release_note")
    op.drop_table("release_notes")
'''


@pytest.fixture
def next_release(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """This process's migrations: this release's plus the synthetic next one."""
    head = migrate.head_revision()
    location = tmp_path / "migrations"
    shutil.copytree(migrate.MIGRATIONS, location, ignore=shutil.ignore_patterns("__pycache__"))
    (location / "versions" / f"{NEXT}_next_release.py").write_text(
        textwrap.dedent(SYNTHETIC).format(next=NEXT, head=head)
    )
    monkeypatch.setattr(migrate, "MIGRATIONS", location)
    migrate.revisions.cache_clear()
    migrate.floors.cache_clear()
    try:
        assert migrate.head_revision() == NEXT
        yield head
    finally:
        monkeypatch.undo()
        migrate.revisions.cache_clear()
        migrate.floors.cache_clear()


@pytest.fixture
def upgrade_cluster(
    tmp_path: Path, chaos_db_url: str, zk_ensemble: ZooKeeperEnsemble
) -> Iterator[Cluster]:
    made = Cluster(
        tmp_path / "daemons",
        db_url=chaos_db_url,
        zookeeper=zk_ensemble.hosts,
        zookeeper_root=f"/upgrade_{uuid.uuid4().hex[:12]}",
        partition_count=PARTITIONS,
        session_timeout=SESSION_TIMEOUT_SECONDS,
    )
    try:
        yield made
    finally:
        made.close()


def log_lock_waits(server: PostgresServer, url: str) -> int:
    """Every session of the database started from now logs each lock wait longer than
    LOCK_WAIT_LOG_MS (Postgres's log_lock_waits); returns the log's current size."""
    database = make_url(url).database
    server.admin(f'ALTER DATABASE "{database}" SET log_lock_waits = on')
    server.admin(f"ALTER DATABASE \"{database}\" SET deadlock_timeout = '{LOCK_WAIT_LOG_MS}ms'")
    return server.log_path.stat().st_size


def lock_waits(server: PostgresServer, offset: int) -> list[tuple[float, str]]:
    """(ms, what) of every lock wait logged after `offset`, longest first."""
    with server.log_path.open("rb") as log:
        log.seek(offset)
        lines = log.read().decode(errors="replace").splitlines()
    found = [
        (float(m.group(4)), f"{m.group(1)} {m.group(2)} on {m.group(3)}")
        for line in lines
        if (m := _LOCK_WAIT.search(line))
    ]
    return sorted(found, reverse=True)


def probe_lock_wait(url: str) -> None:
    """One lock wait of about 3 * LOCK_WAIT_LOG_MS on a table of its own: lock_waits must
    see it, or the measurement of the upgrade's waits would prove nothing."""
    engine = make_engine(url)
    try:
        with engine.begin() as connection:
            connection.execute(text("CREATE TABLE lock_probe (id INTEGER)"))
        with engine.connect() as holder, engine.connect() as waiter:
            holder.execute(text("LOCK TABLE lock_probe IN ACCESS EXCLUSIVE MODE"))
            timer = threading.Timer(3 * LOCK_WAIT_LOG_MS / 1000, holder.rollback)
            timer.start()
            waiter.execute(text("SELECT count(*) FROM lock_probe"))
            waiter.rollback()
            timer.join()
        with engine.begin() as connection:
            connection.execute(text("DROP TABLE lock_probe"))
    finally:
        engine.dispose()


def owner_url(runtime_url: str) -> str:
    """The database owner's URL (runs DDL) from the runtime role's (the daemons')."""
    url = make_url(runtime_url)
    return url.set(username="postgres").render_as_string(hide_password=False)


@pytest.mark.chaos
@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.zookeeper
@pytest.mark.timeout(400)
def test_daemons_keep_working_through_an_online_upgrade_and_downgrade(
    upgrade_cluster: Cluster, chaos_db_url: str, next_release: str, chaos_pg: PostgresServer
) -> None:
    cluster, head = upgrade_cluster, next_release
    store = cluster.store
    figures = Figures()
    log_offset = log_lock_waits(chaos_pg, chaos_db_url)
    probe_lock_wait(owner_url(chaos_db_url))
    probed = lock_waits(chaos_pg, log_offset)
    assert any("AccessShareLock" in what for _, what in probed), "log_lock_waits saw nothing"
    log_offset = chaos_pg.log_path.stat().st_size
    create_load(store)
    cluster.start("relay", "relay")
    worker = "worker-" + CONSUMED_QUEUE
    cluster.start_worker(
        worker, CONSUMED_QUEUE, tenant="quorum" if worker_accepts_tenant() else None
    )
    for name in DISPATCHERS:
        cluster.start(name)
    figures.seconds("dispatchers balanced", cluster.wait_balanced(DISPATCHERS, WAIT_SECONDS))
    time.sleep(WARMUP_SECONDS)
    assert runs_count(store) > 0, "nothing was claimed before the upgrade"

    engine = make_engine(owner_url(chaos_db_url))
    try:
        figures.fault("db upgrade to the next release")
        steps = migrate.upgrade_steps(engine)
        assert [s.target for s in steps] == [NEXT]
        assert migrate.current_revision(engine) == NEXT
        assert "release_note" in {c["name"] for c in inspect(engine).get_columns("jobs")}
        time.sleep(BETWEEN_SECONDS)
        # an old host restarting during the rolling upgrade: it starts on the newer schema
        assert cluster.terminate("d1") == 0
        cluster.start("d1")
        figures.seconds(
            "d1 restarted on the newer schema, balanced",
            cluster.wait_balanced(DISPATCHERS, WAIT_SECONDS),
        )
        time.sleep(BETWEEN_SECONDS)
        figures.fault("db downgrade back to this release")
        down = migrate.downgrade_steps(engine)
        assert migrate.current_revision(engine) == head
    finally:
        engine.dispose()
    time.sleep(BETWEEN_SECONDS)

    cutoff = store.now()
    done, took = wait_until(lambda: pending(store, cutoff).settled, SETTLE_SECONDS, interval=0.2)
    figures.note("settled after " + (f"{took:.3f} s" if done else "NOT in time"))
    dead = cluster.dead()
    starts = {name: d.starts for name, d in cluster.daemons.items()}
    errors_logged = cluster.count_in_logs(" ERROR ")
    tracebacks = cluster.count_in_logs("Traceback")
    exits = {name: cluster.terminate(name) for name in [*DISPATCHERS, "relay", worker]}
    history = load_history(store, cutoff, figures.faults)
    report = check(history)
    for step in [*steps, *down]:
        figures.note(
            f"migration {step.source} -> {step.target}: {step.seconds:.3f} s, "
            f"{step.attempts} attempt(s) (lock_timeout {migrate.LOCK_TIMEOUT_MS} ms)"
        )
    figures.note(
        f"longest migration step (bounds every lock held): "
        f"{max(s.seconds for s in [*steps, *down]):.3f} s"
    )
    waits = lock_waits(chaos_pg, log_offset)
    figures.note(
        f"lock waits over {LOCK_WAIT_LOG_MS} ms (log_lock_waits), any session: {len(waits)}"
        + (f"; longest {waits[0][0]:.0f} ms ({waits[0][1]})" if waits else "")
    )
    for ms, what in waits[:5]:
        figures.note(f"  {ms:.0f} ms: {what}")
    figures.note(f"claim lateness, all runs: {lateness(history.runs)}")
    figures.note("checker:\n" + report.summary())

    assert report.ok, report.summary()
    assert report.occurrences_expected > 0
    assert errors_logged == dict.fromkeys(errors_logged, 0), errors_logged
    assert tracebacks == dict.fromkeys(tracebacks, 0), tracebacks
    assert not dead, f"daemons exited by themselves: {dead}"
    assert starts == {"relay": 1, worker: 1, "d1": 2, "d2": 1}, starts
    assert exits == dict.fromkeys(exits, 0), f"a daemon did not stop cleanly: {exits}"
