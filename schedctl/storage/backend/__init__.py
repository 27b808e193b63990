"""Owns where Postgres and SQLite differ: the Dialect seam and its two implementations."""
