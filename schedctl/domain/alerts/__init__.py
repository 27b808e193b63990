"""Owns alerts: who is told when a job's runs fail, are dead-lettered, or stop succeeding."""
