"""The in-process coordinator of the embedded mode: one process owns every partition."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from schedctl.core import errors
from schedctl.storage.db.store import Store
from schedctl.storage.pipeline.partitions import PartitionRepo


class LocalCoordinator:
    """Owns all partitions under one epoch, higher than any epoch stored before, so a
    previous incarnation of this process (killed, still paused somewhere) is fenced off."""

    def __init__(self, store: Store, owner: str) -> None:
        self.store = store
        self.owner = owner
        self._owned: Mapping[int, int] = MappingProxyType({})

    def start(self) -> None:
        repo = PartitionRepo(self.store)
        partitions = range(self.store.partition_count)
        for _ in range(5):  # another process racing for the same epoch: go above it
            epoch = repo.max_epoch() + 1
            acquired = repo.acquire(partitions, epoch, self.owner)
            if len(acquired) == len(partitions):
                self._owned = MappingProxyType(dict.fromkeys(partitions, epoch))
                return
        raise errors.FencingError("could not acquire the partitions: another dispatcher is racing")

    def stop(self) -> None:
        owned, self._owned = self._owned, MappingProxyType({})
        if owned:
            PartitionRepo(self.store).release(owned.keys(), self.owner)

    def owned(self) -> Mapping[int, int]:
        return self._owned
