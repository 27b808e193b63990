"""Owns what the scheduler keeps to read back: the audit log, run output and metrics,
retention, status, alerts and the web console's reads."""
