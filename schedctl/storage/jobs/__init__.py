"""Owns a job's storage: create, look up, update and delete, its payload, quota use, change
notifications, boot runs and host drift."""
