"""Sending alerts: the relay's alert lane (webhook, e-mail) and the host
worker's alert commands."""
