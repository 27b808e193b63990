"""The physical schema as SQLAlchemy Core tables; migrations must build exactly this."""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Table,
    Text,
    UniqueConstraint,
    false,
    text,
)

from schedctl.storage.db.types import UTCDateTime

metadata = MetaData()

# Postgres wants BIGINT identity keys; SQLite only autoincrements INTEGER PRIMARY KEY.
BigId = BigInteger().with_variant(Integer(), "sqlite")

settings = Table(
    "settings",
    metadata,
    Column("key", String(64), primary_key=True),
    Column("value", Text, nullable=False),
)

tenants = Table(
    "tenants",
    metadata,
    Column("tenant_id", String(40), primary_key=True),
    Column("name", String(200), nullable=False, unique=True),
    # the HMAC key of deliveries; like payloads, `enc:v1:<Fernet token>` when payload keys
    # are configured (schedctl.storage.tenants.signing_secrets)
    Column("signing_secret", Text, nullable=False),
    Column("max_jobs", Integer, nullable=False),
    Column("create_rate_per_minute", Integer, nullable=False),
    Column("dispatch_rate_per_second", Integer, nullable=False),
    Column("allow_list", Text, nullable=False),  # JSON list of host names and CIDRs
    Column("created_at", UTCDateTime, nullable=False),
    # deliveries of this tenant in flight at once, per kind (HTTP, RabbitMQ), per relay
    Column("delivery_concurrency", Integer, nullable=False, server_default="16"),
    # amqp:// URL of the tenant's RabbitMQ; NULL: its queue targets are the built-in queue
    Column("broker_url", Text, nullable=True),
    # the secret before the last rotation (stored like signing_secret), which keeps signing
    # next to the new one until signing_secret_previous_until; NULL: none
    Column("signing_secret_previous", Text, nullable=True),
    Column("signing_secret_previous_until", UTCDateTime, nullable=True),
    # upper bounds kept by creates (storage/jobs/quotas.py): jobs holding a max_jobs slot, and
    # jobs created after quota_rate_since; NULL: not known, the next create counts
    Column("quota_slots_bound", Integer, nullable=True),
    Column("quota_rate_since", UTCDateTime, nullable=True),
    Column("quota_rate_bound", Integer, nullable=True),
)

api_tokens = Table(
    "api_tokens",
    metadata,
    Column("token_id", String(40), primary_key=True),
    Column("tenant_id", String(40), ForeignKey("tenants.tenant_id"), nullable=False),
    Column("token_hash", String(64), nullable=False, unique=True),
    Column("created_at", UTCDateTime, nullable=False),
    Column("revoked_at", UTCDateTime, nullable=True),
    # a host token's host and groups (JSON list); NULL for a tenant token (migration 0016)
    Column("host", String(63), nullable=True),
    Column("groups", Text, nullable=True),
)

jobs = Table(
    "jobs",
    metadata,
    Column("job_id", String(40), primary_key=True),
    Column("tenant_id", String(40), ForeignKey("tenants.tenant_id"), nullable=False),
    Column("name", String(200), nullable=False),
    Column("schedule", Text, nullable=False),  # JSON, see scheduling.schedules.schedule_to_dict
    Column("target_type", String(16), nullable=False),
    Column("target", Text, nullable=False),  # queue name or URL
    Column("payload", Text, nullable=False),  # JSON
    Column("max_attempts", Integer, nullable=False),
    Column("retry_base_seconds", Float, nullable=False),
    Column("retry_max_seconds", Float, nullable=False),
    Column("misfire_policy", String(16), nullable=False),
    Column("grace_seconds", Integer, nullable=False),
    Column("window_seconds", Integer, nullable=False),
    Column("max_concurrency", Integer, nullable=False),
    Column("timeout_seconds", Integer, nullable=False),
    # the run policy (schedctl/domain/runpolicy.py, 0020): overlap and per-run cgroup limits
    Column("overlap", String(16), nullable=False, server_default="queue"),
    Column("memory_max", BigInteger, nullable=True),
    Column("cpu_weight", Integer, nullable=True),
    Column("tasks_max", Integer, nullable=True),
    Column("start_at", UTCDateTime, nullable=True),
    Column("end_at", UTCDateTime, nullable=True),
    Column("status", String(16), nullable=False),
    Column("next_run_at", UTCDateTime, nullable=True),  # nominal time of the next run
    Column(
        "next_fire_at", UTCDateTime, nullable=True
    ),  # next_run_at + window jitter; NULL unless active
    Column("partition", Integer, nullable=False),
    Column("version", BigInteger, nullable=False),
    Column("idempotency_key", String(200), nullable=True),
    Column("request_hash", String(64), nullable=False),
    Column("created_at", UTCDateTime, nullable=False),
    Column("updated_at", UTCDateTime, nullable=False),
    # per-job run counts and durations on /metrics (0018; bounded per tenant by the
    # operator's metrics_max_jobs_per_tenant)
    Column("metrics", Boolean, nullable=False, server_default=false()),
    UniqueConstraint("tenant_id", "idempotency_key", name="uq_jobs_tenant_idempotency"),
    # the due index: "due before T in partitions S" is a range read per partition
    Index("ix_jobs_due", "partition", "next_fire_at"),
    Index("ix_jobs_tenant", "tenant_id", "job_id"),
    Index("ix_jobs_tenant_status", "tenant_id", "status"),
    # a name is unique per tenant among jobs not deleted (0010; 'deleted' frees the name)
    Index(
        "uq_jobs_tenant_name",
        "tenant_id",
        "name",
        unique=True,
        postgresql_where=text("status <> 'deleted'"),
        sqlite_where=text("status <> 'deleted'"),
    ),
)

# every job's name, for the console's name search (0023): kept by triggers on jobs (insert,
# an UPDATE naming name or tenant_id, delete), so the trigram index is off jobs, whose
# every claim would otherwise enter a new row version into it
job_names = Table(
    "job_names",
    metadata,
    Column("job_id", String(40), nullable=False),
    Column("tenant_id", String(40), nullable=False),
    Column("name", String(200), nullable=False),
    PrimaryKeyConstraint("job_id", name="pk_job_names"),
)
# the search is a case-insensitive substring (Postgres with pg_trgm only: SQLite scans)
Index(
    "ix_job_names_name_trgm",
    job_names.c.name,
    postgresql_using="gin",
    postgresql_ops={"name": "gin_trgm_ops"},
).ddl_if(dialect="postgresql")

runs = Table(
    "runs",
    metadata,
    Column("job_id", String(40), nullable=False),
    Column("scheduled_at", UTCDateTime, nullable=False),
    Column("tenant_id", String(40), nullable=False),
    Column("partition", Integer, nullable=False),
    Column("trigger", String(16), nullable=False),
    Column("status", String(16), nullable=False),
    Column("attempt", Integer, nullable=False),
    Column("fire_at", UTCDateTime, nullable=True),
    Column("dispatched_at", UTCDateTime, nullable=True),
    Column("started_at", UTCDateTime, nullable=True),
    Column("finished_at", UTCDateTime, nullable=True),
    Column("exit_code", Integer, nullable=True),
    Column("error", Text, nullable=True),
    Column("output_tail", Text, nullable=True),
    Column("epoch", BigInteger, nullable=True),
    Column("job_version", BigInteger, nullable=True),
    # run identity; also what makes a double claim impossible
    PrimaryKeyConstraint("job_id", "scheduled_at", name="pk_runs"),
    # a tenant's failed runs of the last day (the console's late page, 0021): a few runs
    # in a hundred, so a range of this index instead of a read of the day's partitions
    Index(
        "ix_runs_tenant_failed",
        "tenant_id",
        "scheduled_at",
        "job_id",
        postgresql_where=text("status IN ('failed', 'dead', 'lost')"),
        sqlite_where=text("status IN ('failed', 'dead', 'lost')"),
    ),
    postgresql_partition_by="RANGE (scheduled_at)",
)

run_attempts = Table(
    "run_attempts",
    metadata,
    Column("id", BigId, primary_key=True, autoincrement=True),
    Column("job_id", String(40), nullable=False),
    Column("scheduled_at", UTCDateTime, nullable=False),
    Column("attempt", Integer, nullable=False),
    Column("status", String(16), nullable=False),
    Column("started_at", UTCDateTime, nullable=True),
    Column("finished_at", UTCDateTime, nullable=True),
    Column("exit_code", Integer, nullable=True),
    Column("error", Text, nullable=True),
    Column("output_tail", Text, nullable=True),
    Column("worker", String(200), nullable=True),
    Index("ix_run_attempts_run", "job_id", "scheduled_at"),
)

outbox = Table(
    "outbox",
    metadata,
    Column("id", BigId, primary_key=True, autoincrement=True),
    Column("job_id", String(40), nullable=False),
    Column("scheduled_at", UTCDateTime, nullable=False),
    Column("tenant_id", String(40), nullable=False),
    Column("target_type", String(16), nullable=False),
    Column("target", Text, nullable=False),
    Column("attempt", Integer, nullable=False),
    # due time; while a relay delivers the row, the end of its lease
    Column("available_at", UTCDateTime, nullable=False),
    Column("created_at", UTCDateTime, nullable=False),
    Column("lease_owner", String(200), nullable=True),  # the relay delivering it, if any
    Column("last_error", Text, nullable=True),  # why the previous attempt failed
    # the job's stored payload as it was when a later update changed it (0009): a run
    # claimed before the update is delivered with the definition it was claimed under
    Column("payload", Text, nullable=True),
    # the built-in queue relay reads one target type in due order
    Index("ix_outbox_type_available", "target_type", "available_at"),
    # HTTP/RabbitMQ delivery reads each tenant's lane in due order
    Index("ix_outbox_lane", "tenant_id", "target_type", "available_at"),
)

queue_messages = Table(
    "queue_messages",
    metadata,
    Column("id", BigId, primary_key=True, autoincrement=True),
    Column("queue", String(200), nullable=False),
    Column("job_id", String(40), nullable=False),
    Column("scheduled_at", UTCDateTime, nullable=False),
    Column("tenant_id", String(40), nullable=False),
    Column("attempt", Integer, nullable=False),
    Column("available_at", UTCDateTime, nullable=False),
    Column("leased_until", UTCDateTime, nullable=True),
    Column("lease_owner", String(200), nullable=True),
    Column("created_at", UTCDateTime, nullable=False),
    # like outbox.payload (0009): the payload of the definition the run was claimed under
    Column("payload", Text, nullable=True),
    UniqueConstraint("job_id", "scheduled_at", name="uq_queue_messages_run"),
    # a queue is (tenant, name): a worker reads its tenant's unleased messages in due
    # order (0015: leased ones are not in it; reads by job_id use uq_queue_messages_run)
    Index(
        "ix_queue_messages_ready",
        "tenant_id",
        "queue",
        "available_at",
        postgresql_where=text("leased_until IS NULL"),
        sqlite_where=text("leased_until IS NULL"),
    ),
    # the lease's count of a job's leased messages reads only those (0007)
    Index(
        "ix_queue_messages_leased_job",
        "job_id",
        postgresql_where=text("leased_until IS NOT NULL"),
        sqlite_where=text("leased_until IS NOT NULL"),
    ),
)

dead_letters = Table(
    "dead_letters",
    metadata,
    Column("id", BigId, primary_key=True, autoincrement=True),
    Column("job_id", String(40), nullable=False),
    Column("scheduled_at", UTCDateTime, nullable=False),
    Column("tenant_id", String(40), nullable=False),
    Column("target_type", String(16), nullable=False),
    Column("target", Text, nullable=False),
    Column("attempts", Integer, nullable=False),
    Column("last_error", Text, nullable=True),
    Column("created_at", UTCDateTime, nullable=False),
    Column("replayed_at", UTCDateTime, nullable=True),
    Index("ix_dead_letters_tenant", "tenant_id", "id"),
    # retention deletes by age (0019)
    Index("ix_dead_letters_created", "created_at"),
)

partitions = Table(
    "partitions",
    metadata,
    Column("partition", Integer, primary_key=True, autoincrement=False),
    Column("epoch", BigInteger, nullable=False),
    Column("owner", String(200), nullable=True),
    Column("updated_at", UTCDateTime, nullable=False),
)

audit_log = Table(
    "audit_log",
    metadata,
    Column("id", BigId, primary_key=True, autoincrement=True),
    Column("at", UTCDateTime, nullable=False),
    Column("tenant_id", String(40), nullable=True),
    Column("actor", String(200), nullable=False),
    Column("action", String(40), nullable=False),
    Column("job_id", String(40), nullable=True),
    Column("detail", Text, nullable=True),  # JSON; never the payload
    Index("ix_audit_log_tenant", "tenant_id", "id"),
    Index("ix_audit_log_at", "at"),  # retention deletes by age (0019)
)

# Job-file drift (0022): what each cron host's worker last found different between its
# job files and the central jobs, as `schedctl apply --check` would (storage/jobs/host_drift.py)
host_drift = Table(
    "host_drift",
    metadata,
    Column("tenant_id", String(40), nullable=False),
    Column("host", String(63), nullable=False),
    Column("drift", Text, nullable=False),  # JSON list of "action name"; [] when in step
    Column("checked_at", UTCDateTime, nullable=False),
    PrimaryKeyConstraint("tenant_id", "host", name="pk_host_drift"),
)

# Worker presence (0008): the workers of each tenant's built-in queue, by name, with when
# they last leased or heartbeat and until when that makes them live (storage/pipeline/workers.py).
workers = Table(
    "workers",
    metadata,
    Column("tenant_id", String(40), nullable=False),
    Column("queue", String(200), nullable=False),
    Column("worker", String(200), nullable=False),
    Column("last_seen", UTCDateTime, nullable=False),
    Column("live_until", UTCDateTime, nullable=False),
    PrimaryKeyConstraint("tenant_id", "queue", "worker", name="pk_workers"),
)

# -- alerts (0012) ---------------------------------------------------------------------

alert_settings = Table(
    "alert_settings",
    metadata,
    Column("tenant_id", String(40), nullable=False),
    # '' is the tenant's default, used by its jobs that have no settings of their own
    Column("job_id", String(40), nullable=False),
    Column("config", Text, nullable=False),  # JSON, see schedctl.domain.alerts.model.AlertConfig
    Column("updated_at", UTCDateTime, nullable=False),
    PrimaryKeyConstraint("tenant_id", "job_id", name="pk_alert_settings"),
)

alerts = Table(
    "alerts",
    metadata,
    Column("id", BigId, primary_key=True, autoincrement=True),
    Column("tenant_id", String(40), nullable=False),
    Column("job_id", String(40), nullable=False),
    # the run's nominal time; for no_success, the start of the episode (the last success)
    Column("scheduled_at", UTCDateTime, nullable=False),
    Column("kind", String(16), nullable=False),  # dead_letter, failure, no_success
    # the run's attempt of a failure alert (one per attempt); 0 for the other kinds
    Column("run_attempt", Integer, nullable=False),
    Column("channel", String(16), nullable=False),  # webhook, email, command
    Column("destination", Text, nullable=False),  # URL, comma-separated addresses, queue
    Column("body", Text, nullable=False),  # the alert JSON; never the payload
    Column("status", String(16), nullable=False),  # pending, delivered, failed
    Column("attempt", Integer, nullable=False),
    # due time; while a sender holds the row, the end of its lease
    Column("available_at", UTCDateTime, nullable=False),
    Column("lease_owner", String(200), nullable=True),
    Column("last_error", Text, nullable=True),
    Column("created_at", UTCDateTime, nullable=False),
    Column("delivered_at", UTCDateTime, nullable=True),
    # at least once, but one alert per run, kind and channel however often it is settled
    UniqueConstraint(
        "job_id", "scheduled_at", "kind", "run_attempt", "channel", name="uq_alerts_dedupe"
    ),
    Index("ix_alerts_due", "status", "channel", "available_at"),
    # the per-tenant hourly limit counts the tenant's recent deliveries (0017)
    Index("ix_alerts_tenant_delivered", "tenant_id", "delivered_at"),
    Index("ix_alerts_created", "created_at"),  # retention deletes by age (0019)
)

# `after`: a job's upstream jobs (schedctl.storage.pipeline.dependencies). A settled upstream run
# finds its dependents through the upstream index.
job_dependencies = Table(
    "job_dependencies",
    metadata,
    Column("job_id", String(40), nullable=False),
    Column("upstream_job_id", String(40), nullable=False),
    Column("tenant_id", String(40), nullable=False),
    PrimaryKeyConstraint("job_id", "upstream_job_id", name="pk_job_dependencies"),
    Index("ix_job_dependencies_upstream", "upstream_job_id"),
)
