"""The lock server's committer: the shared vector's arithmetic and the progress writes, off the serving thread,
for the requests that arrive together at once (a group commit).

Why: the serving thread (job/train/distributed/lock_server.py) sees every request of every rank. When it also added
each 11.86 MB change, copied the sum for each reply and wrote an fsynced progress record per request (the vector
with it whenever a bucket was saved), it spent ~42-870 ms per bucket and saturated at ~28 CPU pods (bench/RESULTS.md,
"The lock server's cost per bucket"). Now it decides (``LockState``, O(P)) and hands the rest here as a ``Commit``:
this thread takes every commit queued, applies their vector work in the order the server decided it, writes all
their records as one progress object (the stored vector once, if any of them saved a bucket), copies the sum once
for all of them, and only then gives the batch back to the serving thread, which answers and sends the sums. A
reply is therefore never sent before the changes of every request decided before it are stored: what any rank
has seen is what a restart resumes from (the invariant of docs/design/distributed.md). Requests that change nothing
persisted (``reserve``, ``status``) are answered at once.

Memory: the pending updates of buckets done but not yet saved (``SharedVector.pending``) are at most
``PENDING_VECTORS`` vectors in memory (job/train/residency/budget.py counts them in ``memory_budget``); beyond
that they wait in a local temporary file (never needed by a restart, which redoes unsaved buckets).
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
from job.train.distributed.request_trace import mark
from job.train.distributed.server_stats import Stopwatch
from job.train.distributed.shared_vector import SharedVector
from job.types import Bucket

logger = logging.getLogger("biggraph")


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
    """A judged request whose reply waits for its records (and its vector work) to be stored."""

    job: Any  # the request (``Waiting``), answered by the serving thread once committed
    reply: Any
    records: list[dict[str, Any]]
    work: VectorWork = field(default_factory=VectorWork)
    buffer: Optional[torch.Tensor] = None  # the transfer buffer its change arrived in (the sum leaves from one)
    slot: bool = False  # whether ``buffer`` is a transfer slot
    wants_sum: bool = False  # it carried a whole change: the sum goes back to it (a sparse one's rank pulls rows)


@dataclass
class Batch:
    """Commits written together: ``error`` if their progress write failed (then none is answered with its reply);
    ``sum``: the one buffer every sum of the batch is sent from (one of the batch's slots), None if none wants one."""

    commits: list[Commit]
    error: Optional[str] = None
    sum: Optional[torch.Tensor] = None
    sum_slot: bool = False


@dataclass
class CommitStats:
    """The committer thread's time: ``busy_s`` in all, of it ``vector_s`` (adds, stores, the sum's copy) and
    ``progress_s`` (the writes); ``batches`` written, ``commits`` in them."""

    busy_s: float = 0.0
    cpu_s: float = 0.0  # of it on a CPU (the rest waited for a CPU, the GIL or the disk)
    vector_s: float = 0.0
    progress_s: float = 0.0
    batches: int = 0
    commits: int = 0
    shared_writes: int = 0


class Committer:
    """One thread: ``submit`` a commit (from the serving thread); each batch is reported into ``done`` as
    ``("committed", batch)``, and the slots whose change was added (but which do not carry the sum) earlier, as
    ``("added", [buffers])``, so that the next changes can arrive while the batch is written."""

    def __init__(self, vector: SharedVector, progress: Any, done: Callable[[tuple], None]) -> None:
        self.vector = vector
        self.progress = progress
        self._done = done
        self._queue: queue.Queue[Optional[Commit]] = queue.Queue()
        self.stats = CommitStats()
        self.failed: Optional[str] = None
        self._lock = threading.Lock()
        # with the caller's storage settings (the server's creator's: the progress may go to an endpoint of its own)
        self.thread = threading.Thread(target=storage.carry(self._run), name="biggraph-lock-commits", daemon=True)
        self.thread.start()

    def submit(self, commit: Commit) -> None:
        self._queue.put(commit)

    def stop(self) -> None:
        self._queue.put(None)
        self.thread.join(timeout=5)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            s = self.stats
            return {"busy_s": s.busy_s, "cpu_s": s.cpu_s, "vector_s": s.vector_s, "progress_s": s.progress_s,
                    "batches": s.batches, "commits": s.commits, "shared_writes": s.shared_writes}

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch = [first]
            while True:  # everything that arrived meanwhile: one write for all of it
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
        self._mark(commits, "commit_start")
        with Stopwatch() as whole:
            with Stopwatch() as vector_watch, self.vector.lock:
                stored = False
                for commit in commits:
                    work = commit.work
                    if work.change is not None:
                        self.vector.add(work.change, work.rows)
                    if work.finished is not None and work.change is not None:
                        stored |= self.vector.finish(work.finished, work.change, saved=work.saved, rows=work.rows)
                    if work.unsaved is not None:
                        stored |= self.vector.save(work.unsaved)
                wanting = [c for c in commits if c.buffer is not None and c.work.change is not None and c.wants_sum]
                batch = Batch(commits)
                added = []
                if wanting and self.failed is None:  # one copy of the sum for every reply of the batch
                    batch.sum, batch.sum_slot = wanting[0].buffer, wanting[0].slot
                    assert batch.sum is not None
                    batch.sum.copy_(torch.from_numpy(self.vector.served))
                    added = [(c.buffer, c.slot) for c in wanting[1:]]
                    for c in wanting:
                        c.buffer = None
                for c in commits:  # sparse changes: their buffers are free once added
                    if c.buffer is not None and c.work.rows is not None and self.failed is None:
                        added.append((c.buffer, c.slot))
                        c.buffer = None
                if added:
                    self._done(("added", added))
            self._mark(commits, "added")
            records = [record for commit in commits for record in commit.records]
            with Stopwatch() as progress_watch:
                if self.failed is None:
                    try:
                        if stored:  # only the blocks that changed, unless most did
                            blocks = self.vector.changed_blocks()
                            due = self.progress.append(records, shared=self.vector.stored if blocks is None else None,
                                                       blocks=blocks)
                        else:
                            due = self.progress.append(records)
                        if due:
                            self.progress.compact(shared=self.vector.stored)
                    except Exception as err:  # noqa: BLE001 - the group restarts from what is stored
                        self.failed = f"{type(err).__name__}: {err}"
                        logger.warning("lock server: the progress could not be saved (%s); every request is "
                                       "refused from now on", self.failed)
                batch.error = self.failed
            self._mark(commits, "durable")
        with self._lock:
            self.stats.busy_s += whole.seconds
            self.stats.cpu_s += whole.cpu_seconds
            self.stats.vector_s += vector_watch.seconds
            self.stats.progress_s += progress_watch.seconds
            self.stats.batches += 1
            self.stats.commits += len(commits)
            self.stats.shared_writes += int(stored and batch.error is None)
        self._done(("committed", batch))

    @staticmethod
    def _mark(commits: list[Commit], name: str) -> None:
        for commit in commits:  # (traced requests only: request_trace.py)
            mark(getattr(commit.job, "marks", None), name)
