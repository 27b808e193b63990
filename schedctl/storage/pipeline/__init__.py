"""Owns the run pipeline's storage: partition fencing, the claim, the outbox, the built-in
queue, settling, worker presence, dependencies and dead letters."""
