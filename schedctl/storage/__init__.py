"""Durable state: the SQLAlchemy Core schema, migrations and the Store (Postgres, SQLite)."""
