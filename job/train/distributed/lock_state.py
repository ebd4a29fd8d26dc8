"""``LockState``: which bucket a distributed trainer gets next (the lock server's logic, without transport).

It hands a trainer a bucket none of whose partitions another trainer holds, prefers buckets that reuse the partitions
the trainer already holds, honours the initialised-partition rule on the first pass, and tracks which buckets are done
and which partitions were written into the next (uncommitted) checkpoint version. With ``prefetch_partitions`` it also
*reserves* a trainer's next bucket while the current one trains (``reserve``; policy in its docstring).
``next_bucket`` and ``reserve`` cost O(P), not O(P²) or more: they read the open buckets through ``BucketIndex``
(job/train/distributed/bucket_index.py). Pure state, unit-tested on its own (tests/test_distributed.py,
tests/test_distributed_prefetch.py); ``job.train.distributed.lock_server.LockServer`` serves it from rank 0 and
persists it (job/checkpoint/group_progress.py): a snapshot (``to_json``/``restore``) when its pass starts, then, at
every request that changed it, the changes as records (``drain_journal``), which ``apply`` replays onto the snapshot
after a restart.

The records (``{"e": kind, ...}``) are the changes to what a restart keeps, nothing else (locks and reservations
are forgotten by a restart: ``forget_rank_locks``):

- ``start``: ``rank`` trains ``bucket`` (in flight);  ``stop``: ``rank`` has nothing in flight any more
- ``finish``: ``rank`` finished ``bucket`` (done); ``keys``: its partitions, still unwritten by that rank
- ``written``: ``rank`` stored ``keys`` into the next version (dirty; no longer unwritten); ``staged`` (a write
  group, job/checkpoint/write_groups.py): the staged file of each, which a restart moves to its PBG name if still there,
  with its size and CRC-32 (what the commit's manifest takes instead of reading the file back)
- ``cut`` (``write_behind_buckets``, job/train/distributed/cuts.py): ``keys``, every partition trained since the last
  cut, made current at once by the ``staged`` files of every rank: every done bucket is saved (whoever did it), or
  with ``buckets`` (a cut taken in the background, job/train/distributed/cut_behind.py) exactly those
- ``record``: a finished bucket's ``training_stats.json`` line
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from job.train.distributed.bucket_index import BucketIndex, WatchedDict, WatchedSet
from job.types import Bucket, PartitionKey


@dataclass
class LockState:
    """Which buckets are done, which partitions are locked by whom, and what is already written this pass."""

    nparts_lhs: int
    nparts_rhs: int
    bucket_keys: dict[Bucket, frozenset]  # partitioned (type, partition) keys each bucket needs
    tree_init_order: bool = False  # first pass of a fresh run: grow out from partition 0
    version: int = 0  # the checkpoint version this pass will commit
    done: set = field(default_factory=set)
    in_flight: dict = field(default_factory=dict)  # rank -> bucket
    reserved: dict = field(default_factory=dict)  # rank -> its next bucket, granted early (partitions locked)
    world_size: int = 1  # trainers in the group: how many may want a bucket (the reservation policy)
    locks: dict = field(default_factory=dict)  # key -> rank
    dirty: set = field(default_factory=set)  # keys written into `version` during this pass
    trained_parts: set = field(default_factory=set)  # partition numbers trained this pass
    redone: int = 0
    acquired: int = 0
    # rank -> done bucket -> its partitions that rank still holds unwritten: if the rank dies, the bucket's
    # training dies with them, so it goes back to the queue
    unsaved: dict = field(default_factory=dict)
    records: list = field(default_factory=list)  # training_stats.json lines of the finished buckets
    journal: list = field(default_factory=list)  # the changes not yet persisted (``drain_journal``)
    # key -> the rank that last started a bucket training it: where its latest rows are in this round (a cut taken in
    # the background stages each partition there: job/train/distributed/cut_behind.py); not persisted
    trainer: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._watch()

    def _watch(self) -> None:
        """Have the containers the index follows report their changes, and (re)build the index (``BucketIndex``:
        what keeps ``next_bucket`` and ``reserve`` O(P))."""
        self._index: Optional[BucketIndex] = None
        self.locks = WatchedDict(self._lock_changed, self.locks)
        self.in_flight = WatchedDict(self._taken_changed, self.in_flight)
        self.reserved = WatchedDict(self._taken_changed, self.reserved)
        self.done = WatchedSet(self._done_changed, self.done)
        self.trained_parts = WatchedSet(self._part_trained, self.trained_parts)
        self._index = BucketIndex(self)

    @property
    def index(self) -> BucketIndex:
        assert self._index is not None
        return self._index

    def _lock_changed(self, key: Any, old: Any, new: Any) -> None:
        if self._index is not None:
            self._index.lock_changed(key, old, new)

    def _taken_changed(self, rank: Any, old: Any, new: Any) -> None:
        if self._index is not None:
            self._index.taken_changed(rank, old, new)

    def _done_changed(self, bucket: Bucket) -> None:
        if self._index is not None:
            self._index.refresh(bucket)

    def _part_trained(self, part: int) -> None:
        if self._index is not None and self.tree_init_order:
            self._index.part_trained(part)

    @property
    def total(self) -> int:
        return self.nparts_lhs * self.nparts_rhs

    def finished(self) -> bool:
        return len(self.done) == self.total and not self.in_flight

    def eligible(self, bucket: Bucket) -> bool:
        """The initialised-partition rule (``distributed_tree_init_order``, first pass of a fresh run)."""
        if not self.tree_init_order or self.total == 1:
            return True
        return 0 in (bucket.lhs, bucket.rhs) or bool({bucket.lhs, bucket.rhs} & self.trained_parts)

    def next_bucket(self, rank: int, held: set, finished: Optional[Bucket], rng: Any) -> tuple[str, Optional[Bucket]]:
        """Finish ``finished`` (if any) and pick the next bucket for ``rank``: ("bucket", b), ("wait", None) or ("done", None).
        A bucket reserved for ``rank`` is its next one (its partitions are locked for it already)."""
        self._end_in_flight(rank, finished)
        ahead = self.reserved.pop(rank, None)
        if ahead is not None:
            self._change({"e": "start", "rank": rank, "bucket": list(ahead)})
            return "bucket", ahead
        # affinity: the most partitions already held, then random. A bucket sharing any lies near what it holds (O(P));
        # only when none does is the choice among every bucket it may take
        near = [(len(self.bucket_keys[b] & held), b) for b in self.index.near_takeable(rank, held)]
        if near:
            best = max(n for n, _ in near)
            group: Sequence[Bucket] = sorted(b for n, b in near if n == best)
        else:
            group = self._open_to(rank)
            if not group:
                remaining = self.total - len(self.done)
                return ("done", None) if remaining == 0 else ("wait", None)
        choice = rng.choice(group)
        for key in self.bucket_keys[choice]:
            self.locks[key] = rank
        self._change({"e": "start", "rank": rank, "bucket": list(choice)})
        return "bucket", choice

    def _end_in_flight(self, rank: int, finished: Optional[Bucket]) -> None:
        """``rank``'s bucket in flight ends: done if it is ``finished``, else given up (a restart redoes it)."""
        if finished is not None and self.in_flight.get(rank) == finished:
            self._change({"e": "finish", "rank": rank, "bucket": list(finished),
                          "keys": sorted([list(k) for k in self.bucket_keys[finished]])})
        if rank in self.in_flight:
            self._change({"e": "stop", "rank": rank})

    def stop(self, rank: int, finished: Optional[Bucket], keep_reserved: bool = False) -> None:
        """The round ends: finish ``finished`` (if ``rank`` had it in flight) and hand ``rank`` nothing more, its
        reservation dropped with the locks only it needed (partitions not read yet, or read ahead and unchanged:
        the rank's give-back writes and releases the ones it holds, ``settled`` waits for that). ``keep_reserved``:
        its reservation stays (a turn in a cut taken in the background: the rank trains it next)."""
        current = self.in_flight.get(rank)
        self._end_in_flight(rank, finished)
        if keep_reserved:
            return
        ahead = self.reserved.pop(rank, None)
        if ahead is not None:
            keep = self.bucket_keys[current] if current is not None else frozenset()
            for key in self.bucket_keys[ahead] - keep:
                if self.locks.get(key) == rank:
                    del self.locks[key]

    def unsaved_buckets(self) -> set[Bucket]:
        """The buckets done whose partitions are not all written yet (a restart redoes them)."""
        return {b for pending in self.unsaved.values() for b in pending}

    def settled(self, rank: int, saved: bool = True) -> bool:
        """Whether ``rank`` holds nothing a restart would redo or wait on: no bucket in flight, none done whose
        partitions it has not written (``saved``; written behind, nothing unsaved can be saved once the round
        ends), no lock (its write groups recorded and published, or its locks given back unwritten)."""
        return (rank not in self.in_flight and not (saved and self.unsaved.get(rank))
                and rank not in self.locks.values())

    def _open_to(self, rank: int, also_trained: frozenset = frozenset()) -> Sequence[Bucket]:
        """The buckets ``rank`` may take now: not done, nobody's (in flight or reserved), no partition locked by
        another rank, eligible under the initialised-partition rule (``also_trained``: partitions that count as
        trained, i.e. those of the bucket ``rank`` trains before this one). The free ones ascending (a seeded choice is
        reproducible), then the others sorted; never a copy of the free ones (a sequence read on demand)."""
        extras = self.index.extras(rank, also_trained)
        if not extras:
            return self.index.free.items
        return self.index.free.items + sorted(extras)

    def reserve(self, rank: int, rng: Any, leaving: frozenset = frozenset()) -> Optional[Bucket]:
        """Grant ``rank``'s next bucket now, while it trains its current one, and lock its partitions for it.

        Policy (no starvation): a reservation never takes a partition another rank holds (the usual rule), and
        it takes a *free* partition only if the other ranks still waiting for work (every other rank without a
        reservation) keep at least one open bucket each that the new locks do not touch. Among the grantable
        buckets the one needing the fewest new partitions wins (then one sharing a partition the rank holds, then
        random): usually a bucket sharing the current one's partitions, which costs nobody anything and the trainer
        no read. None: nothing fits (the rank asks again, the usual way, when its bucket is done). One reservation
        per rank at a time.
        ``leaving``: partitions the rank is writing back in the background; it holds their locks until they are
        stored (``release``), but they count as new partitions here, as they would after the release."""
        current = self.in_flight.get(rank)
        if current is None or rank in self.reserved:
            return self.reserved.get(rank)
        mine = self.index.held.get(rank, set()) - leaving
        # the candidates by cost: those touching a partition the rank locks (or eligible through its current
        # bucket) one by one, O(P); the free ones, which touch none, cost as many partitions as they need
        extras, costs = self.index.extra_costs(rank, frozenset((current.lhs, current.rhs)), mine)
        for cost in sorted(set(costs.tolist()) | set(self.index.size_set)):  # the free ones of a cost read when reached
            near = extras.subset(costs == cost)
            for bucket in _random_order(rng, near, self.index.free_of_size(cost)):
                new = self.bucket_keys[bucket] - mine
                if new and not self._leaves_enough(rank, new):
                    continue
                for key in new:
                    self.locks[key] = rank
                self.reserved[rank] = bucket
                return bucket
        return None

    def _leaves_enough(self, rank: int, new: frozenset) -> bool:
        """Whether the other ranks that still need a next bucket find one each after ``rank`` locks ``new``: the
        buckets some other rank could take now (none locked by ``rank``, all the locked ones held by one and the
        same rank) that touch none of ``new``."""
        demand = self.world_size - 1 - sum(1 for other in self.reserved if other != rank)
        if demand <= 0:
            return True
        return self.index.open_to_others_count(rank, new) >= demand

    def release(self, rank: int, keys: list, written: bool = True) -> None:
        """``rank`` wrote ``keys`` into the next version and gives up their locks (but not those its current or
        reserved bucket needs: that bucket would lose them to another rank)."""
        needed: set[PartitionKey] = set()
        for bucket in (self.in_flight.get(rank), self.reserved.get(rank)):
            if bucket is not None:
                needed |= self.bucket_keys[bucket]
        keys = [(k[0], int(k[1])) for k in keys]
        for key in keys:
            if self.locks.get(key) == rank and key not in needed:
                del self.locks[key]
        if written and keys:
            self.record_written(rank, keys)

    def record_written(self, rank: int, keys: Sequence[Sequence[Any]], staged: Sequence[Sequence[Any]] = ()) -> None:
        """``rank`` made ``keys`` current in the next version, all in this one record (a write group: ``staged``
        names each one's staged file, ``[type, partition, name]`` or with ``size, crc32`` after it); its locks stay
        (``release`` frees them)."""
        event: dict[str, Any] = {"e": "written", "rank": rank, "keys": [[k[0], int(k[1])] for k in keys]}
        if staged:
            event["staged"] = [[entry[0], int(entry[1]), str(entry[2]), *entry[3:5]] for entry in staged]
        self._change(event)

    def record_cut(self, keys: Sequence[Sequence[Any]], staged: Sequence[Sequence[Any]],
                   buckets: Optional[Sequence[Bucket]] = None) -> None:
        """A cut (job/train/distributed/cuts.py): ``keys`` made current by ``staged`` (every rank's files), saving
        every done bucket of every rank in this one record, or exactly ``buckets`` (a cut taken in the background:
        job/train/distributed/cut_behind.py; the buckets started after it began stay unsaved)."""
        event: dict[str, Any] = {"e": "cut", "keys": [[k[0], int(k[1])] for k in keys],
                                 "staged": [[entry[0], int(entry[1]), str(entry[2]), *entry[3:5]] for entry in staged]}
        if buckets is not None:
            event["buckets"] = [list(b) for b in buckets]
        self._change(event)

    def add_record(self, record: dict[str, Any]) -> None:
        """A finished bucket's stats line (the committing rank writes them all at the commit)."""
        self._change({"e": "record", "record": record})

    def _change(self, event: dict[str, Any]) -> None:
        self.apply(event)
        self.journal.append(event)

    def drain_journal(self) -> list[dict[str, Any]]:
        """The changes since the last call, to persist (see the module docstring)."""
        events, self.journal = self.journal, []
        return events

    def apply(self, event: dict[str, Any]) -> None:
        """One change (a record of ``drain_journal``): made here as the server runs, and replayed onto the pass's
        snapshot after a restart."""
        kind = event["e"]
        rank = int(event.get("rank", -1))
        if kind == "start":
            self.in_flight[rank] = started = Bucket(*event["bucket"])
            self.acquired += 1
            for key in self.bucket_keys.get(started, ()):
                self.trainer[key] = rank
        elif kind == "stop":
            # a bucket in flight that ends unfinished was given up (job/train/schedule/clock.py): trained again
            self.redone += self.in_flight.pop(rank, None) is not None
        elif kind == "finish":
            bucket = Bucket(*event["bucket"])
            self.done.add(bucket)
            self.trained_parts.update((bucket.lhs, bucket.rhs))
            self.in_flight.pop(rank, None)
            if event["keys"]:
                self.unsaved.setdefault(rank, {})[bucket] = {(k[0], int(k[1])) for k in event["keys"]}
        elif kind == "written":
            pending = self.unsaved.get(rank, {})
            for k in event["keys"]:
                key = (k[0], int(k[1]))
                self.dirty.add(key)
                for bucket in list(pending):
                    pending[bucket].discard(key)
                    if not pending[bucket]:
                        del pending[bucket]
            if rank in self.unsaved and not pending:
                del self.unsaved[rank]
        elif kind == "cut":  # one record for the whole group: every bucket done so far is in the files it names
            self.dirty.update((k[0], int(k[1])) for k in event["keys"])
            if "buckets" not in event:
                self.unsaved.clear()
            else:  # a cut taken in the background saves its own buckets, not those started after it began
                saved = {Bucket(*b) for b in event["buckets"]}
                for owner in list(self.unsaved):
                    pending = self.unsaved[owner]
                    for bucket in saved & set(pending):
                        del pending[bucket]
                    if not pending:
                        del self.unsaved[owner]
        elif kind == "record":
            self.records.append(event["record"])
        else:
            raise ValueError(f"unknown progress record {kind!r}")

    def forget_rank_locks(self) -> dict[int, int]:
        """After a restart nobody holds anything: in-flight buckets will be redone, and so will finished ones
        whose partitions were still held (their updates were never written; their stats lines are dropped with
        them, the redo records its own). Reserved buckets were never
        started: they go back to the queue, not counted as redone. Returns the buckets to redo by the rank (of the
        round that ended) that held them: since a round's end is drained, only lost ranks should appear."""
        by_rank: dict[int, int] = {}
        for rank in self.in_flight:
            by_rank[rank] = by_rank.get(rank, 0) + 1
        for rank, pending in self.unsaved.items():
            if pending:
                by_rank[rank] = by_rank.get(rank, 0) + len(pending)
        self.redone += len(self.in_flight)
        self.in_flight.clear()
        self.reserved.clear()
        lost = {b for pending in self.unsaved.values() for b in pending}
        self.done -= lost
        self.redone += len(lost)
        # their stats lines go with them: the redo adds its own, and the committed training_stats.json holds one line
        # per bucket and pass (bench/chaos_bench.py found 56 kept twice after 100 events)
        self.records = [r for r in self.records
                        if "lhs_partition" not in r or Bucket(r["lhs_partition"], r["rhs_partition"]) not in lost]
        self.unsaved.clear()
        self.locks.clear()
        self.trainer.clear()
        return by_rank

    def to_json(self) -> dict[str, Any]:
        return {
            "version": self.version, "done": sorted(list(b) for b in self.done),
            "in_flight": {str(r): list(b) for r, b in self.in_flight.items()},
            "reserved": {str(r): list(b) for r, b in self.reserved.items()},
            "dirty": sorted([list(k) for k in self.dirty]), "trained_parts": sorted(self.trained_parts),
            "redone": self.redone, "acquired": self.acquired, "records": self.records,
            "unsaved": {str(r): [[*b, sorted([list(k) for k in keys])] for b, keys in pending.items()]
                        for r, pending in self.unsaved.items()},
        }

    def restore(self, data: dict[str, Any]) -> None:
        self.done = {Bucket(*b) for b in data.get("done", [])}
        self.in_flight = {int(r): Bucket(*b) for r, b in data.get("in_flight", {}).items()}
        self.reserved = {int(r): Bucket(*b) for r, b in data.get("reserved", {}).items()}
        self.dirty = {(k[0], int(k[1])) for k in data.get("dirty", [])}
        self.trained_parts = set(data.get("trained_parts", []))
        self.redone = int(data.get("redone", 0))
        self.acquired = int(data.get("acquired", 0))
        self.records = list(data.get("records", []))
        self.unsaved = {int(r): {Bucket(lhs, rhs): {(k[0], int(k[1])) for k in keys} for lhs, rhs, keys in pending}
                        for r, pending in data.get("unsaved", {}).items()}
        self._watch()


def _random_order(rng: Any, first: Sequence[Bucket], second: Sequence[Bucket]) -> Iterator[Bucket]:
    """The buckets of ``first`` in a random order, then those of ``second`` in a random order, each drawn lazily (a
    sparse Fisher-Yates): a reservation usually takes one of the first few, so a group of P² free buckets costs what
    it uses. Of equal cost, a bucket sharing a partition the rank holds (``first``) comes before a free one."""
    for group in (first, second):
        n = len(group)
        moved: dict[int, int] = {}
        for i in range(n):
            j = rng.randrange(i, n)
            at = moved.get(j, j)
            moved[j] = moved.get(i, i)
            yield group[at]
