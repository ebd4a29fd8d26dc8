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

With writes behind (``write_behind_buckets``, job/train/distributed/cuts.py) a holder is recorded by a release that
wrote nothing: its rows are then newer than the file, the only copy of the buckets trained since the last cut. The
record is ``strict`` then: a gone holder is still named, so that its receiver fails (and the round ends, rolling
back to the last cut) instead of reading the older file.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Optional

from job.types import Bucket, PartitionKey

Kept = tuple[str, int, str]  # a released partition whose rows its rank keeps: (entity type, partition, digest)
Holder = tuple[str, int, int, str]  # where a granted partition's rows are kept: (entity type, partition, rank, digest)


class Holders:
    """Partition -> (rank, digest) of the rows kept in memory that equal its current file (see the module docstring).
    ``bucket_keys``: the partitions of each bucket; ``gone``: the ranks declared dead or lost now (never named)."""

    def __init__(self, bucket_keys: Mapping[Bucket, frozenset], gone: Callable[[], Collection[int]]) -> None:
        self._at: dict[PartitionKey, tuple[int, str]] = {}
        self._bucket_keys = bucket_keys
        self._gone = gone
        # writes behind (job/train/distributed/cuts.py): a holder's rows may be newer than the file, so a gone holder
        # is still named (its receiver fails and ends the round) instead of leaving the receiver to read a stale file
        self.strict = False

    def holder(self, key: PartitionKey) -> Optional[int]:
        """The rank named as keeping ``key``'s latest rows, if any."""
        at = self._at.get((key[0], int(key[1])))
        return at[0] if at is not None else None

    def adopt(self, other: Optional[Holders]) -> None:
        """Take ``other``'s record (the previous pass's server, once that pass committed: each partition's committed
        file is what it last published, so a holder it names still keeps the current rows)."""
        if other is not None:
            self._at.update(other._at)

    def written(self, keys: Iterable[PartitionKey]) -> None:
        """``keys`` are being made current from new rows: whatever a rank kept of them is stale from now on."""
        for key in keys:
            self._at.pop((key[0], int(key[1])), None)

    def released(self, rank: int, keys: Collection[PartitionKey], kept: Sequence[Kept], written: bool) -> None:
        """``rank`` released ``keys`` (``written``: and wrote them now, a plain release) and keeps the rows of ``kept``
        (a subset, published before this release) in memory."""
        if written:
            self.written(keys)
        for entity_type, part, digest in kept:
            if (entity_type, part) in keys:
                self._at[(entity_type, part)] = (rank, digest)

    def grant(self, bucket: Optional[Bucket], skip: Collection[PartitionKey]) -> tuple[Holder, ...]:
        """The holders of ``bucket``'s partitions, for its grant (not ``skip``: what the rank holds or is writing
        itself), leaving out ranks known to be gone (dead, fenced): their rows went with them."""
        if bucket is None or not self._at:
            return ()
        gone = self._gone() if not self.strict else ()
        out = []
        for key in sorted(self._bucket_keys[bucket]):
            at = self._at.get(key)
            if at is not None and key not in skip and at[0] not in gone:
                out.append((key[0], key[1], at[0], at[1]))
        return tuple(out)

    def __len__(self) -> int:
        return len(self._at)
