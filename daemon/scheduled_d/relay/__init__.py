"""The outbox relay, a package of its components: `Relay` is what the rest of the daemon
uses."""

from scheduled_d.relay.loop import DEFAULT_LEASE_SECONDS, Relay, RelayStats, lease_margin

__all__ = ["DEFAULT_LEASE_SECONDS", "Relay", "RelayStats", "lease_margin"]
