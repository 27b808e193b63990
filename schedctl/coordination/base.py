"""The Coordinator protocol every ownership backend implements (local, ZooKeeper)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol


class Coordinator(Protocol):
    """Decides which partitions this process owns and the fencing epoch of each.

    `owned()` is empty whenever ownership is in doubt (a suspended ZooKeeper session):
    the dispatcher must stop claiming at once. The epoch of a partition only grows across
    owners, and the coordinator writes it to the partitions table before reporting the
    partition as owned, so a claim made under an older epoch commits nothing.
    """

    def start(self) -> None:
        """Join the cluster and acquire partitions; returns once the first assignment is done."""

    def stop(self) -> None:
        """Leave the cluster and release partitions at once so others take them over."""

    def owned(self) -> Mapping[int, int]:
        """Partition -> epoch for every partition this process may claim right now."""
        ...
