"""The lock server's committer: the shared vector's arithmetic and the progress writes, off the serving thread,
for the requests that arrive together at once (a group commit).

Why: the serving thread (job/train/distributed/lock_server.py) sees every request of every rank. When it also added
each 11.86 MB change, copied the sum for each reply and wrote an fsynced progress record per request (the vector
with it whenever a bucket was saved), it spent ~42-870 ms per bucket and saturated at ~28 CPU pods (bench/RESULTS.md,
"The lock server's cost per bucket"). Now it decides (``LockState``, O(P)) and hands the rest here as a ``Commit``.
Two threads, in the order the server decided (issue #45):

- the *vector* thread takes every commit queued, applies their vector work, copies the sum once for all of them,
  takes the stored vector's blocks that changed (copied), reports the batch ``("ready", batch)`` and hands it to
  the writer;
- the *writer* thread takes every batch queued and writes all their records as one progress object (the stored
  vector's changes once: their blocks merged, or the whole vector copied under the vector's lock as those batches
  leave it, when most of it changed or a compaction needs it), then reports each ``("committed", batch)``. The
  vector thread never waits for a write: a slow fsync (12-170 ms on the bench's VM) delays only the replies that
  wait for it.

Which replies wait for their records (``replies_early``): all, except a ``next`` that grants a bucket or says
``wait``, which leaves at ``ready`` (its sum included), before its record is stored. Why that is safe: every later
effect of that trainer that storage can hold goes through this server and this log, in order: its partitions
become current only by a ``written`` or ``cut`` record and its staged files are moved only after that record's
reply, which waits for it and so for every record before it (the log is written in order, and one write that fails
stops every later one: ``failed``); the shared vector is stored only by records; reservations and hand-offs are
memory. A rank 0 that dies before the record is stored ends the round for every rank, whose memory is discarded:
the restart replays the log without that record and redoes the finished bucket, as if the reply had never left.
The replies that lead a trainer to write, leave or wait for the group (``done``, ``ending``, ``cut``, ``written``,
``release``, ``sync``, a cut's steps) wait, so every record before them is stored when the trainer acts on them.
docs/design/distributed.md has the whole argument; tests/test_lock_protocol.py kills rank 0 with such a record
unwritten at every step of a pass.

Memory: the pending updates of buckets done but not yet saved (``SharedVector.pending``) are at most
``PENDING_VECTORS`` vectors in memory (job/train/residency/budget.py counts them in ``memory_budget``); beyond
that they wait in a local temporary file (never needed by a restart, which redoes unsaved buckets). A batch queued
for the writer holds a copy of its changed blocks (KBs); a write of the whole vector (most of it changed, or a
compaction over block files) takes one copy of it while it is written, one at a time.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

import storage_adapters as storage
from job.checkpoint.group_progress import VectorBlocks
from job.train.distributed.protocol import Granted, Next
from job.train.distributed.request_trace import mark
from job.train.distributed.server_stats import Stopwatch
from job.train.distributed.shard_service import set_rows
from job.train.distributed.shared_vector import SharedVector
from job.types import Bucket

logger = logging.getLogger("biggraph")

# what a committer calls to have every shard save buckets: each shard's changed stored rows and their values
ShardSave = Callable[[list[Bucket]], list[tuple[np.ndarray, np.ndarray]]]


@dataclass
class VectorWork:
    """What one request does to the shared vector, decided by the serving thread and done by the committer."""

    change: Optional[np.ndarray] = None  # added to the served vector (a bucket's change, or a sync's)
    rows: Optional[np.ndarray] = None  # a sparse change's relation rows (job/train/distributed/shared_rows.py)
    pull: Optional[np.ndarray] = None  # a pull's rows: their served values to send (read by the serving thread)
    finished: Optional[Bucket] = None  # a bucket done with ``change``: stored now if ``saved``, else pending
    saved: bool = False
    unsaved: Optional[frozenset[Bucket]] = None  # after the request: the buckets not in it have their updates stored


@dataclass
class Commit:
    """A judged request whose reply waits for its vector work, and unless ``early`` for its records to be stored."""

    job: Any  # the request (``Waiting``), answered by the serving thread once committed
    reply: Any
    records: list[dict[str, Any]]
    work: VectorWork = field(default_factory=VectorWork)
    buffer: Optional[torch.Tensor] = None  # the transfer buffer its change arrived in (the sum leaves from one)
    slot: bool = False  # whether ``buffer`` is a transfer slot
    wants_sum: bool = False  # it carried a whole change: the sum goes back to it (a sparse one's rank pulls rows)
    early: bool = False  # answered once its vector work is done, before its records are stored (``replies_early``)


def replies_early(request: Any, reply: Any) -> bool:
    """Whether ``reply`` may leave before the records of ``request`` are stored: a ``next`` granting a bucket or
    saying ``wait`` (why that is safe: this module's docstring). Every other reply waits for its records."""
    return isinstance(request, Next) and isinstance(reply, Granted) and reply.kind in ("bucket", "wait")


@dataclass
class Batch:
    """Commits whose vector work was done together: ``error`` if their progress write failed (then none still
    waiting is answered with its reply); ``sum``: the one buffer every sum of the batch is sent from (one of the
    batch's slots), None if none wants one; ``ready``: reported ready (its early replies left then)."""

    commits: list[Commit]
    error: Optional[str] = None
    sum: Optional[torch.Tensor] = None
    sum_slot: bool = False
    ready: bool = False


@dataclass
class Write:
    """What the writer stores for a batch: its ``records`` and the stored vector's changes since the batch before:
    its changed ``blocks``, or ``whole`` (most of it changed: the writer copies it)."""

    batch: Batch
    records: list[dict[str, Any]]
    blocks: Optional[VectorBlocks] = None
    whole: bool = False


@dataclass
class CommitStats:
    """The committer's time: ``busy_s`` in all, of it ``vector_s`` (adds, stores, the sum's copy: the vector
    thread) and ``progress_s`` (the writes: the writer thread); ``batches`` written (one progress write each),
    ``commits`` in them."""

    busy_s: float = 0.0
    cpu_s: float = 0.0  # of it on a CPU (the rest waited for a CPU, the GIL or the disk)
    vector_s: float = 0.0
    progress_s: float = 0.0
    batches: int = 0
    commits: int = 0
    shared_writes: int = 0


class Committer:
    """Two threads: ``submit`` a commit (from the serving thread); each batch is reported into ``done`` as
    ``("ready", batch)`` once its vector work is done (unless a write failed before), then ``("committed", batch)``
    once its records are stored, and the slots whose change was added (but which do not carry the sum) earlier, as
    ``("added", [buffers])``, so that the next changes can arrive while the batch is written."""

    def __init__(self, vector: SharedVector, progress: Any, done: Callable[[tuple], None],
                 shard_save: Optional[ShardSave] = None) -> None:
        self.vector = vector
        # ``shared_shards``: asks every shard to save the buckets a record saves, and returns each one's stored rows
        # that changed since its last save, with their values (job/train/distributed/shard_service.py)
        self.shard_save = shard_save
        self.progress = progress
        self._done = done
        self._queue: queue.Queue[Optional[Commit]] = queue.Queue()
        self._writes: queue.Queue[Optional[Write]] = queue.Queue()
        self._compact_due = False  # the log is due for a compaction over block files: the next write is whole
        self.stats = CommitStats()
        self.failed: Optional[str] = None
        self._lock = threading.Lock()
        # with the caller's storage settings (the server's creator's: the progress may go to an endpoint of its own)
        self.thread = threading.Thread(target=storage.carry(self._run), name="biggraph-lock-commits", daemon=True)
        self.writer = threading.Thread(target=storage.carry(self._write_loop), name="biggraph-lock-progress",
                                       daemon=True)
        self.thread.start()
        self.writer.start()

    def submit(self, commit: Commit) -> None:
        self._queue.put(commit)

    def stop(self) -> None:
        """Write what was submitted, then end both threads."""
        self._queue.put(None)
        self.thread.join(timeout=5)
        self.writer.join(timeout=5)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            s = self.stats
            return {"busy_s": s.busy_s, "cpu_s": s.cpu_s, "vector_s": s.vector_s, "progress_s": s.progress_s,
                    "batches": s.batches, "commits": s.commits, "shared_writes": s.shared_writes}

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                self._writes.put(None)
                return
            batch = [first]
            while True:  # everything that arrived meanwhile: one batch
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._queue.put(None)  # stop after this batch
                    break
                batch.append(more)
            try:
                self._commit(batch)
            except Exception:  # noqa: BLE001 - never reached by a write's failure (reported in the batch)
                logger.exception("lock server: a commit of %d requests failed", len(batch))

    def _commit(self, commits: list[Commit]) -> None:
        """The vector thread's part of a batch: its vector work, the sum, what its write needs; then ``ready``."""
        self._mark(commits, "commit_start")
        with Stopwatch() as watch, self.vector.lock:
            stored = False
            saved: list[Bucket] = []  # the buckets whose updates enter ``stored`` now
            for commit in commits:
                work = commit.work
                if work.change is not None:
                    self.vector.add(work.change, work.rows)
                if work.finished is not None and work.change is not None:
                    if self.vector.finish(work.finished, work.change, saved=work.saved, rows=work.rows):
                        stored = True
                        saved.append(work.finished)
                if work.unsaved is not None:
                    moved = self.vector.save(work.unsaved)
                    stored |= bool(moved)
                    saved += moved
            if saved and self.shard_save is not None and self.failed is None:
                stored |= self._save_shards(saved)
            wanting = [c for c in commits if c.buffer is not None and c.work.change is not None and c.wants_sum]
            batch = Batch(commits, ready=self.failed is None)
            write = Write(batch, [record for commit in commits for record in commit.records])
            added = []
            if wanting and batch.ready:  # one copy of the sum for every reply of the batch
                batch.sum, batch.sum_slot = wanting[0].buffer, wanting[0].slot
                assert batch.sum is not None
                batch.sum.copy_(torch.from_numpy(self.vector.served))
                added = [(c.buffer, c.slot) for c in wanting[1:]]
                for c in wanting:
                    c.buffer = None
            for c in commits:  # sparse changes: their buffers are free once added
                if c.buffer is not None and c.work.rows is not None and batch.ready:
                    added.append((c.buffer, c.slot))
                    c.buffer = None
            if stored and batch.ready:  # only the blocks that changed, unless most did
                write.blocks = self.vector.changed_blocks()
                write.whole = write.blocks is None
            if added:
                self._done(("added", added))
            self._mark(commits, "added")
            if batch.ready:  # (before the writer can report it committed)
                self._done(("ready", batch))
            # under the lock: what the writer finds queued is what ``stored`` holds when it takes the lock
            self._writes.put(write)
        with self._lock:
            self.stats.busy_s += watch.seconds
            self.stats.cpu_s += watch.cpu_seconds
            self.stats.vector_s += watch.seconds

    def _save_shards(self, buckets: list[Bucket]) -> bool:
        """The shards save ``buckets`` too; their stored rows that changed go into ``stored`` before the record that
        saves them is written (one persisted vector: docs/design/distributed.md, "Sparse shared parameters"). A shard
        that does not answer fails the commit as a failed write does (every later request is refused: the round
        ends); whether ``stored`` changed."""
        assert self.shard_save is not None
        try:
            answers = self.shard_save(buckets)
        except Exception as err:  # noqa: BLE001 - the group restarts from what is stored
            self.failed = f"the shards of the shared vector did not save {len(buckets)} bucket(s): {err}"
            logger.warning("lock server: %s; every request is refused from now on", self.failed)
            return False
        changed = False
        for rows, values in answers:
            if rows.size:
                set_rows(self.vector.layout, self.vector.stored, rows, values)
                changed = True
        return changed

    def _write_loop(self) -> None:
        while True:
            first = self._writes.get()
            if first is None:
                return
            group: list[Write] = [first]
            stopping = False
            with self.vector.lock:  # every batch queued, and the stored vector as they leave it if it is written whole
                while True:
                    try:
                        more = self._writes.get_nowait()
                    except queue.Empty:
                        break
                    if more is None:
                        stopping = True
                        break
                    group.append(more)
                whole = self.vector.stored.copy() if self.failed is None and (
                    any(write.whole for write in group) or self._compact_due) else None
            try:
                self._write(group, whole)
            except Exception:  # noqa: BLE001 - never reached by a write's failure (reported in the batches)
                logger.exception("lock server: a progress write of %d batches failed", len(group))
            if stopping:
                return

    def _write(self, group: list[Write], whole: Optional[np.ndarray]) -> None:
        """The writer thread's part: every record of ``group`` as one progress object, with the stored vector's
        changes (``whole``: the vector as they leave it, else their blocks merged), a compaction when due; then
        each batch ``committed``."""
        with Stopwatch() as watch:
            records = [record for write in group for record in write.records]
            blocks = merged_blocks(group) if whole is None else None
            if self.failed is None:
                try:
                    if whole is not None or blocks is not None:
                        due = self.progress.append(records, shared=whole, blocks=blocks)
                    else:
                        due = self.progress.append(records)
                    # a compaction over block files rewrites the vector as the records leave it (``ProgressLog.
                    # compact``): the next write then carries it whole, and compacts
                    self._compact_due = bool(due) and len(getattr(self.progress, "vector_files", ())) > 1
                    if due and not self._compact_due:
                        self.progress.compact(shared=whole)
                except Exception as err:  # noqa: BLE001 - the group restarts from what is stored
                    self.failed = f"{type(err).__name__}: {err}"
                    logger.warning("lock server: the progress could not be saved (%s); every request is "
                                   "refused from now on", self.failed)
        for write in group:
            write.batch.error = self.failed
            self._mark(write.batch.commits, "durable")
        with self._lock:
            self.stats.busy_s += watch.seconds
            self.stats.cpu_s += watch.cpu_seconds
            self.stats.progress_s += watch.seconds
            self.stats.batches += 1
            self.stats.commits += sum(len(write.batch.commits) for write in group)
            self.stats.shared_writes += int((whole is not None or blocks is not None) and self.failed is None)
        for write in group:
            self._done(("committed", write.batch))

    @staticmethod
    def _mark(commits: list[Commit], name: str) -> None:
        for commit in commits:  # (traced requests only: request_trace.py)
            mark(getattr(commit.job, "marks", None), name)


def merged_blocks(group: list[Write]) -> Optional[VectorBlocks]:
    """The stored vector's changed blocks of the writes of ``group``, in order, as one: their union, a later
    write's values over an earlier one's (blocks hold values, not differences)."""
    blocks: Optional[VectorBlocks] = None
    for write in group:
        if write.blocks is not None and blocks is None:
            blocks = write.blocks
        elif write.blocks is not None and blocks is not None:
            index = np.union1d(blocks.index, write.blocks.index)
            values = np.empty((index.size, blocks.block), np.float32)
            values[np.searchsorted(index, blocks.index)] = blocks.values
            values[np.searchsorted(index, write.blocks.index)] = write.blocks.values
            blocks = VectorBlocks(index, values, write.blocks.tail, blocks.block)
    return blocks
