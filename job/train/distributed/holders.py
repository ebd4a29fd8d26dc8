"""The lock server's record of where each partition's latest rows are in memory (issue 45, ``partition_handoff``).

A rank that publishes a write group and releases its leaving partitions may keep their rows in memory
(job/train/distributed/handoff.py) and says so in the ``release`` (``kept``: each partition with the digest of the rows
it published). The server remembers that rank as the partition's *holder* and names it, with the digest, in the grant
of every bucket that needs the partition (``Granted.holders``, ``Reserved.holders``): the next rank to train it asks
the holder for the rows instead of reading the file, and checks them against the digest.

Why that is safe: a holder is recorded only by the release that follows the holder's own ``written`` record and
publication of the partition, so the rows it keeps are byte for byte what the partition's file holds then; and any
later ``written`` of the partition (another rank's group, or a plain written release) forgets the holder before the
file changes. So a grant names a holder only while the rows kept there are the current file's, and a rank that finds
the holder gone, or rows that fail the digest, reads the file as it would have anyway. Nothing here is persisted: a
new round's processes hold nothing in memory, so after a restart every partition is read from storage, as before.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

from job.train.distributed.protocol import Holder, Kept
from job.types import PartitionKey


class Holders:
    """Partition -> (rank, digest) of the rows kept in memory that equal its current file (see the module docstring)."""

    def __init__(self) -> None:
        self._at: dict[PartitionKey, tuple[int, str]] = {}

    def written(self, keys: Iterable[PartitionKey]) -> None:
        """``keys`` are being made current from new rows: whatever a rank kept of them is stale from now on."""
        for key in keys:
            self._at.pop((key[0], int(key[1])), None)

    def released(self, rank: int, keys: Collection[PartitionKey], kept: Sequence[Kept]) -> None:
        """``rank`` released ``keys`` after publishing them and keeps the rows of ``kept`` (a subset) in memory."""
        for entity_type, part, digest in kept:
            if (entity_type, part) in keys:
                self._at[(entity_type, part)] = (rank, digest)

    def for_grant(self, keys: Iterable[PartitionKey], skip: Collection[PartitionKey],
                  gone: Collection[int]) -> tuple[Holder, ...]:
        """The holders of ``keys`` a granted bucket reads (not ``skip``: what the rank holds or is writing itself),
        leaving out ranks known to be gone (dead, fenced): their rows went with them."""
        out = []
        for key in sorted(keys):
            at = self._at.get(key)
            if at is not None and key not in skip and at[0] not in gone:
                out.append((key[0], key[1], at[0], at[1]))
        return tuple(out)

    def __len__(self) -> int:
        return len(self._at)
