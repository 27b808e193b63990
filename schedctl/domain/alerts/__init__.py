"""Owns alert settings: who is told when a job's runs fail, are dead-lettered, or stop
succeeding, the operator's policy for them, and their Prometheus series (sending them is
schedctl.app.alerts)."""
