"""Delivery to targets: signed HTTP calls, per-tenant limits, the RabbitMQ publisher and
e-mail alerts, shared by the relay and the workers (the SSRF guard they call is
schedctl.core.ssrf)."""
