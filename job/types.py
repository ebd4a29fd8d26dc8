"""The shared vocabulary of biggraph: the names that training, checkpoints, the lock protocol and growth all use.

Torch-free and dependency-free, so that anything (the Kubernetes sizing, the checkpoint manager, the lock
protocol) can import it without pulling in the hot path. PBG keeps its own in ``torchbiggraph/types.py``."""

from __future__ import annotations

from typing import NamedTuple

EntityType = str
Partition = int
# (entity type, partition): one partition of one entity type's embedding table, the unit that is locked,
# swapped, written and checksummed
PartitionKey = tuple[EntityType, Partition]


class Bucket(NamedTuple):
    """(lhs partition, rhs partition): the edges whose left side is in partition ``lhs`` and right side in ``rhs``,
    the unit of work of a pass (PBG's bucket)."""

    lhs: Partition
    rhs: Partition

    def __str__(self) -> str:
        return f"({self.lhs}, {self.rhs})"


__all__ = ["Bucket", "EntityType", "Partition", "PartitionKey"]
