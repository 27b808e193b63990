"""Owns the database itself: engines, the schema and its migrations, the Store and its
transactions, column types, the clock, page cursors, row conversions, roles, backup and
scratch databases."""
