"""scheduled-d: the scheduler daemon (dispatcher, relay, API, queue workers)."""
