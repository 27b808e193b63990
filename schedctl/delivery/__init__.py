"""Delivery to targets: signed HTTP calls, the SSRF guard, per-tenant limits
and the RabbitMQ publisher, shared by the relay and the workers."""
