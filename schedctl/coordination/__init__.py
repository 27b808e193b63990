"""Partition ownership: which dispatcher may claim which partitions, under which epoch."""
