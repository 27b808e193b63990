"""Durable state (Postgres, SQLite), in sub-packages: db (engines, the schema, migrations,
the Store), backend (the Dialect seam), pipeline (claim, outbox, queue, settle), jobs,
tenants and records (audit, run output and metrics, alerts, status, the console's reads)."""
