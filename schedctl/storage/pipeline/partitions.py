"""Partition ownership records: the fencing epoch each owner writes before it claims."""

from __future__ import annotations

from collections.abc import Collection, Mapping

from sqlalchemy import func, or_, select, update

from schedctl.storage.backend.dialect import Lock
from schedctl.storage.db import schema
from schedctl.storage.db.clock import db_now
from schedctl.storage.db.store import Store


class PartitionRepo:
    def __init__(self, store: Store) -> None:
        self.store = store

    def acquire(self, partitions: Collection[int], epoch: int, owner: str) -> set[int]:
        """Record `epoch` as the owner's for each partition whose stored epoch is older
        (or is this same owner's); returns the partitions acquired. A partition whose stored
        epoch is newer belongs to someone else now and is not touched."""
        return self.acquire_each(dict.fromkeys(partitions, epoch), owner)

    def acquire_each(self, epochs: Mapping[int, int], owner: str) -> set[int]:
        """`acquire` with an epoch per partition (the ZooKeeper coordinator's epochs are
        each owner node's creation zxid); returns the partitions acquired."""
        if not epochs:
            return set()
        table = schema.partitions
        acquired: set[int] = set()
        with self.store.tx() as connection:
            now = db_now(connection)
            # a fixed order, so two acquirers lock rows in the same order and cannot deadlock
            ordered = sorted(epochs)
            for start in range(0, len(ordered), 500):
                chunk = ordered[start : start + 500]
                statement = self.store.dialect.insert(table).values(
                    [
                        {"partition": p, "epoch": epochs[p], "owner": owner, "updated_at": now}
                        for p in chunk
                    ]
                )
                statement = statement.on_conflict_do_update(
                    index_elements=[table.c.partition],
                    set_={
                        "epoch": statement.excluded.epoch,
                        "owner": statement.excluded.owner,
                        "updated_at": statement.excluded.updated_at,
                    },
                    where=or_(
                        table.c.epoch < statement.excluded.epoch,
                        (table.c.epoch == statement.excluded.epoch)
                        & (table.c.owner == statement.excluded.owner),
                    ),
                ).returning(table.c.partition)
                acquired.update(connection.execute(statement).scalars())
        return acquired

    def release(self, partitions: Collection[int], owner: str) -> None:
        """Mark partitions unowned (the epoch stays: the next owner must exceed it)."""
        if not partitions:
            return
        with self.store.tx() as connection:
            # rows locked in partition order first, like acquire() and the claim's FOR
            # SHARE: the UPDATE alone would lock them in its scan's order
            self.store.dialect.lock_rows(
                connection,
                select(schema.partitions.c.partition)
                .where(schema.partitions.c.partition.in_(sorted(partitions)))
                .order_by(schema.partitions.c.partition),
                Lock.no_key_update,
            )
            connection.execute(
                update(schema.partitions)
                .where(
                    schema.partitions.c.partition.in_(sorted(partitions)),
                    schema.partitions.c.owner == owner,
                )
                .values(owner=None, updated_at=db_now(connection))
            )

    def max_epoch(self) -> int:
        with self.store.read() as connection:
            value = connection.execute(select(func.max(schema.partitions.c.epoch))).scalar()
        return int(value or 0)

    def epochs(self) -> dict[int, tuple[int, str | None]]:
        with self.store.read() as connection:
            rows = connection.execute(
                select(
                    schema.partitions.c.partition,
                    schema.partitions.c.epoch,
                    schema.partitions.c.owner,
                )
            ).all()
        return {int(r[0]): (int(r[1]), r[2]) for r in rows}
