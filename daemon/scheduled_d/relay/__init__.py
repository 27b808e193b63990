"""The outbox relay, a package of its components: `Relay` (loop.py) is what the rest of the
daemon uses."""

from scheduled_d.relay.loop import DEFAULT_LEASE_SECONDS, Relay, lease_margin
from scheduled_d.relay.stats import RelayStats

__all__ = ["DEFAULT_LEASE_SECONDS", "Relay", "RelayStats", "lease_margin"]
