"""Who trains which bucket next, and how trainers share parameters: one interface for one process and
for a torchrun group, so that ``Trainer._run_pass`` (job/train/trainer.py) is one loop that never asks
whether it runs alone (PBG splits its trainer the same way: a bucket scheduler and a parameter client).

- ``LocalScheduler`` walks the whole pass in one process, in the configured bucket order (``buffer``:
  the order with the fewest partition loads for the buffer, starting from what is resident).
- ``LockServerScheduler`` (job/train/schedule/group.py) asks the lock server on rank 0
  (job/train/distributed/lock_server.py) for one bucket at a time; rank 0 also keeps every rank's bucket records (across a
  group restart) and commits.
- ``NoSync`` / ``SharedSync`` (job/train/schedule/shared_sync.py): relation parameters, global embeddings and
  unpartitioned tables are private to a lone process, and pushed/pulled through the lock server at every bucket
  boundary in a group (the request through the store, the vectors point-to-point with rank 0:
  job/train/distributed/transport.py).

Prefetch (the next bucket's edge file and, with ``prefetch_partitions``, its partitions while the
current bucket trains) needs ``upcoming()``: the buckets this process will train next, whose
partitions no other process can write meanwhile. Locally that is the rest of the pass. In a group
the lock server picks buckets as ranks ask, so the rank asks for its next one early: right after it
receives a bucket (and has started writing back the partitions the new bucket does not use, as one write group
with the ones it keeps: job/checkpoint/write_groups.py) it
asks the server to *reserve* the following one (``LockState.reserve``: the reserved bucket's
partitions are locked for this rank, and it is granted only when it leaves the other ranks work).
``upcoming()`` is then that one bucket, and the trainer reads its missing partitions in the background
within the buffer (``PartitionStore.prepare``) while the current bucket trains. Without
``prefetch_partitions`` nothing is reserved and nothing read ahead (PBG's behaviour).

Pass results: the committing process gets every bucket's record (``gather``) and builds the pass
summary from those alone (job/train/pass_stats.py), so both modes write the same stats lines. The eval
MRR that early stopping compares is that summary's: ``publish`` hands the committing process's value
to every rank, so all ranks stop after the same pass.
"""

from __future__ import annotations

import logging
import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from job.config import ConfigSchema
from job.types import Bucket, PartitionKey

logger = logging.getLogger("biggraph")



@dataclass(frozen=True)
class Iteration:
    """One pass over all buckets: an (epoch, edge set, edge chunk) triple; its index is the checkpoint version it makes."""

    index: int
    epoch: int
    edge_path_idx: int
    chunk_idx: int


@dataclass(frozen=True)
class PassPlan:
    """Which passes a run makes: every (epoch, edge set, chunk) of the config, numbered from ``first_index`` (the
    committed version the first one follows: ``biggraph grow`` trains on after the version it committed)."""

    first_index: int = 0

    def iterations(self, config: ConfigSchema, num_chunks: int) -> list[Iteration]:
        triples = ((e, p, c) for e in range(config.num_epochs) for p in range(len(config.edge_paths))
                   for c in range(num_chunks))
        return [Iteration(self.first_index + i, e, p, c) for i, (e, p, c) in enumerate(triples)]


@dataclass
class PassGather:
    """What the committing process knows at the end of a pass: every bucket's record and the others' I/O."""

    records: list[dict[str, Any]]
    others_io: list[dict[str, Any]] = field(default_factory=list)  # partition I/O of the other ranks
    world_size: int = 1
    restart_count: int = 0
    buckets_redone: int = 0


class BucketScheduler(ABC):
    """The buckets of a pass for this process, in order; see the module docstring for prefetch."""

    commits: bool = True  # this process writes the new version and the pass's stats lines
    delays_hogwild: bool = True  # the buckets of epoch 0 stagger their Hogwild workers (hogwild_delay), as PBG

    @abstractmethod
    def start_pass(self, pass_index: int, seed_base: int, version: int) -> None:
        """Prepare pass ``pass_index``, which commits ``version + 1``."""

    @abstractmethod
    def next_bucket(self, finished: Optional[dict[str, Any]]) -> Optional[Bucket]:
        """The next bucket to train (``finished``: the stats record of the one just trained); None: the pass
        has nothing left for this process."""

    def upcoming(self) -> tuple[Sequence[Bucket], Sequence[set[PartitionKey]]]:
        """The buckets this process trains after the current one and their partitions, when known and safe to
        prefetch (nobody else writes those partitions meanwhile); empty when unknown."""
        return (), ()

    def release(self, keys: list[PartitionKey]) -> None:
        """``keys`` were written out of the buffer (others may now take them); nothing to do alone."""
        return None

    def end_buckets(self) -> None:
        """After the last bucket: give back what this process still holds (alone: nobody waits for it)."""
        return None

    def stop_check(self) -> Optional[Callable[[], bool]]:
        """What the bucket in training polls between batches: True gives it up (``BucketAbandoned``, then
        ``abandon``). None (alone): a bucket is always finished."""
        return None

    def abandon(self, why: str) -> None:
        """The bucket in training was given up (``stop_check``): hand back its locks unwritten and leave."""
        raise RuntimeError(f"this scheduler never gives a bucket up ({why})")

    @abstractmethod
    def gather(self, own_io: dict[str, Any]) -> Optional[PassGather]:
        """Wait until every process has finished the pass's buckets; the committing one gets the records."""

    def publish(self, result: dict[str, Any]) -> dict[str, Any]:
        """After the commit: the committing process's pass result (its eval MRR, its validation line: JSON
        values), the same on every process."""
        return result


class LocalScheduler(BucketScheduler):
    """The whole pass in this process, in the order ``order(rng)`` gives."""

    def __init__(self, order: Callable[[random.Random], list[Bucket]],
                 needs: Callable[[Bucket], set[PartitionKey]]) -> None:
        self.order = order
        self.needs = needs
        self.buckets: list[Bucket] = []
        self.needed: list[set[PartitionKey]] = []
        self.position = -1
        self.records: list[dict[str, Any]] = []

    def start_pass(self, pass_index: int, seed_base: int, version: int) -> None:
        self.buckets = self.order(random.Random(seed_base * 7919 + pass_index))
        self.needed = [self.needs(b) for b in self.buckets]
        self.position = -1
        self.records = []

    def next_bucket(self, finished: Optional[dict[str, Any]]) -> Optional[Bucket]:
        if finished is not None:
            self.records.append(finished)
        self.position += 1
        return self.buckets[self.position] if self.position < len(self.buckets) else None

    def upcoming(self) -> tuple[Sequence[Bucket], Sequence[set[PartitionKey]]]:
        return self.buckets[self.position + 1:], self.needed[self.position + 1:]

    def gather(self, own_io: dict[str, Any]) -> Optional[PassGather]:
        return PassGather(records=self.records)


class ParameterSync:
    """Keeps the parameters every trainer updates (not partitioned) the same across processes; this base
    does nothing, which is right for one process (its parameters are the only ones)."""

    def pull(self) -> None:
        """At the start of a pass: take the group's values."""
        return None

    def sync(self) -> None:
        """At a bucket boundary: push this process's change, take the sum."""
        return None

    def prepare(self, edges: Any) -> None:
        """A bucket's edges are read, before it trains: take the group's values of what they read."""
        return None

    def settle(self) -> None:
        """After the pass's last sync: the committing process takes the final values."""
        return None


NoSync = ParameterSync
