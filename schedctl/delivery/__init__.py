"""Delivery policy shared by the relay and the workers: retry backoff and, later, HTTP targets."""
