"""Write groups: how a distributed trainer writes partitions back so that a redone bucket never starts from rows
that already hold its own update (docs/design/distributed.md, "A redone bucket's rows").

The invariant: the file of a partition that the lock server's persisted progress counts as written this pass
(``dirty``) holds the update of every bucket of that partition the progress counts as saved, once, and of no
other bucket. A restart redoes exactly the buckets not saved, so each bucket's update reaches the committed rows
once. Two things broke it: a bucket's partitions were made current one release at a time (a death in between
left one side holding the update of a bucket the restart redoes), and a file was overwritten in place before the
record that made it current. So, at a bucket switch that lets partitions go:

1. **Group.** The rank writes the partitions leaving *and* every partition it keeps for the next bucket (the
   kept ones from a host copy taken at the switch when written behind, since the next bucket trains on them
   meanwhile), each under a staged name of its own (``STAGED_PREFIX``: never a PBG name, so no reader, manifest or
   version listing sees it) in the uncommitted version. An exclusive store holds exactly the finished bucket's
   partitions, so the group holds every row of every done-but-unsaved bucket of the rank.
2. **One record.** One ``written`` request names the group (key -> staged name, with the file's size and CRC-32);
   the server persists one record for all of it, which saves every bucket of the group (with its shared update,
   job/train/distributed/lock_server.py).
3. **Publish.** The rank moves each staged file to its PBG name (``storage_adapters.staging.move``: a rename
   locally, a copy and a removal on object stores, finished by moving again), its checksum record with it, and only
   then frees the locks of the leaving partitions (a second request): the next holder reads the PBG name.
4. **Restart.** Before the new group serves, rank 0 ``roll_forward``s: it moves every staged file a persisted
   record names and that is still there (in record order; a moved one is gone, so this is idempotent) and removes
   the staged files no record names (written, never made current). Then ``known_sums`` gives the new round the
   size and CRC-32 each record carried for the file it made current, so that the commit's manifest takes them
   instead of downloading and hashing every partition an earlier round wrote (the next read of the version still
   verifies each file against the manifest, so a file changed since its write is caught there).

Then the done-but-unsaved buckets of a rank are exactly those none of whose rows left its memory, and a redo reads
files without their update. Cost: one more write of each kept partition per switch that lets another go, a move per
written partition (free locally; a server-side copy on object stores) and one more request per such switch.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import storage_adapters as storage
from job.formats.checkpoint import CheckpointStorage
from job.types import PartitionKey

if TYPE_CHECKING:  # the tables of a group: written here, built by the trainer (torch stays out of recovery)
    from job.model.scoring import Table

logger = logging.getLogger("biggraph")


# ``.tmp-``: the checkpoint manager's clean-up at open removes such names whatever wrote them (job/checkpoint/manager.py)
STAGED_PREFIX = ".tmp-staged-"


def staged_name(key: PartitionKey, version: int, token: str) -> str:
    """The staged file of ``key`` in ``version`` for the group ``token``: not a PBG name (see the module docstring)."""
    entity_type, part = key
    return f"{STAGED_PREFIX}{token}-embeddings_{entity_type}_{part}.v{version}.h5"


@dataclass
class WriteGroup:
    """Partitions a rank writes back together at a bucket switch: ``leaving`` (their locks are freed once the group
    is published) and the kept ones (``names`` has both; ``tables``: what is written, host copies for kept ones
    written behind)."""

    version: int
    leaving: list[PartitionKey]
    tables: dict[PartitionKey, Table]
    names: dict[PartitionKey, str]

    @classmethod
    def of(cls, version: int, leaving: Sequence[PartitionKey], tables: dict[PartitionKey, Table]) -> WriteGroup:
        token = secrets.token_hex(6)
        return cls(version, sorted(leaving), tables, {key: staged_name(key, version, token) for key in tables})

    @property
    def keys(self) -> list[PartitionKey]:
        return sorted(self.names)

    def staged(self, checkpoint: Optional[CheckpointStorage] = None) -> list[list[Any]]:
        """The group as the server's record names it: ``[type, partition, staged name]`` per partition, followed by
        the file's ``size, crc32`` where ``checkpoint`` recorded its write (its files stored: after ``flush``)."""
        entries = []
        for entity_type, part in self.keys:
            name = self.names[(entity_type, part)]
            entry = checkpoint.sums.get(storage.join(checkpoint.url, name)) if checkpoint is not None else None
            entries.append([entity_type, part, name, *(entry or ())])
        return entries


def publish(checkpoint: CheckpointStorage, version: int, key: PartitionKey, name: str) -> bool:
    """Move the staged file ``name`` of ``key`` to its PBG name in ``version``, with its checksum record (the next
    holder verifies its read against it). False when the staged file is not there (moved already). The checkpoint's
    guard (the round's fence and the owner check) runs first: a rank whose round is over, or a run whose directory
    was taken over, moves nothing over the names its successor writes."""
    checkpoint.guard()
    source = storage.join(checkpoint.url, name)
    target = checkpoint.partition_file(version, *key)
    entry = checkpoint.sums.get(source)
    try:
        storage.move(source, target)
    except FileNotFoundError:
        return False
    if entry is not None:
        checkpoint.sums.record(target, entry)
    return True


def publish_group(checkpoint: CheckpointStorage, group: WriteGroup, keys: Optional[Iterable[PartitionKey]] = None) -> None:
    """Publish ``keys`` of ``group`` (all by default), once the server has recorded the group."""
    for key in group.keys if keys is None else keys:
        if not publish(checkpoint, group.version, key, group.names[key]):
            raise FileNotFoundError(f"{storage.join(checkpoint.url, group.names[key])}: the staged file of "
                                    f"{key[0]} partition {key[1]} is gone before it was published")


def known_sums(checkpoint: CheckpointStorage, version: int, recorded: Sequence[Sequence[Any]]) -> int:
    """(Rank 0 of a restarted group.) Record in ``checkpoint.sums`` (shared with the round's ranks) the size and
    CRC-32 of each partition file of ``version`` that the persisted records made current, the last record of a
    partition winning (``recorded``: ``Progress.staged``, in record order); records without them (an older writer)
    are skipped. Returns the files known."""
    latest: dict[PartitionKey, tuple[int, str]] = {}
    for entry in recorded:
        if len(entry) >= 5:
            latest[(str(entry[0]), int(entry[1]))] = (int(entry[3]), str(entry[4]))
        else:
            latest.pop((str(entry[0]), int(entry[1])), None)
    for key, sums in latest.items():
        checkpoint.sums.record(checkpoint.partition_file(version, *key), sums)
    return len(latest)


def roll_forward(checkpoint_path: str, version: int, recorded: Sequence[Sequence[Any]],
                 guard: Optional[Callable[[], None]] = None) -> int:
    """(Rank 0 of a restarted group, before anything is served.) Finish the publication of every staged file the
    persisted records of the pass committing ``version`` name (``recorded``: ``[type, partition, name]`` in record
    order, ``Progress.staged``), then remove the staged files no record names. Idempotent: a kill part-way leaves
    what the next call finishes. Returns the files moved. ``guard``: the checkpoint manager's (round and owner),
    run before every move and before the clean-up."""
    checkpoint = CheckpointStorage(checkpoint_path, guard=guard)
    checkpoint.guard()
    # one listing instead of an existence check per recorded file: most were moved long ago, and a pass's records
    # name hundreds (on an object store each check is a request: seconds of every recovery)
    staged = {name for name in storage.listdir(checkpoint_path) if name.startswith(STAGED_PREFIX)}
    moved = 0
    for entity_type, part, name, *_ in recorded:
        if str(name) in staged:
            staged.discard(str(name))
            moved += publish(checkpoint, version, (str(entity_type), int(part)), str(name))
    checkpoint.guard()
    storage.remove_many([storage.join(checkpoint_path, name) for name in sorted(staged)])
    if moved:
        logger.info("resuming pass to version %d: published %d partition file(s) the interrupted group had recorded",
                    version, moved)
    return moved
