"""Benchmarks shipped with schedctl (`schedctl bench ...`): measured, never asserted."""
