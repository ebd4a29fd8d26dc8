"""``SharedVector``: the shared parameters as the lock server holds them, and which bucket's change a restart keeps.

A ``next`` carries the trainer's change since its last sync for the bucket it finishes; the server adds it to the
vector it serves (``served``) and answers with the sum. What it persists (``stored``) holds the change of a bucket
only once the bucket is done *and* its partitions are written: until then a restart redoes the bucket
(``LockState.forget_rank_locks``), so its change waits in ``pending`` and enters ``stored`` with the record that
saves the bucket. A restart thus resumes with every saved bucket's shared update once and without any bucket it
redoes (docs/ARCHITECTURE.md, invariants; docs/design/distributed.md, "Shared parameters across a restart").

Memory: ``served``, ``stored``, ``persisted`` and at most ``PENDING_VECTORS`` pending updates (job/train/residency/budget.py,
counted in ``memory_budget``); a group with more buckets done but unsaved at once (many pods, each holding a
partition across buckets) keeps the others in local temporary files until their buckets are saved. They are never
needed after a restart (which redoes unsaved buckets), so the files are unnamed and go with the process.
"""

from __future__ import annotations

import tempfile
import threading
from collections.abc import Collection
from dataclasses import dataclass
from typing import IO, Optional

import numpy as np

from job.checkpoint.group_progress import VectorBlocks
from job.train.distributed.shared_rows import RowLayout
from job.train.residency.budget import PENDING_VECTORS
from job.types import Bucket


class SharedVector:
    """The served, stored and pending parts of the shared-parameter vector (float32, one flat vector)."""

    def __init__(self, initial: np.ndarray, in_memory: int = PENDING_VECTORS,
                 layout: Optional[RowLayout] = None) -> None:
        self.served = initial.astype(np.float32, copy=True)
        # which values are relation rows (a sparse change's positions: job/train/distributed/shared_rows.py)
        self.layout = layout if layout is not None else RowLayout.dense(self.served.size)
        self.stored = self.served.copy()  # the updates of the buckets done and saved: what a restart resumes
        self.persisted = self.stored.copy()  # ``stored`` as the progress files last left it (``changed_blocks``)
        # the update of each bucket done but not yet saved: its non-zero values (a bucket touches few relations),
        # or the whole change in one of ``in_memory`` reused vectors, or (beyond) in a temporary file
        self.pending: dict[Bucket, Pending] = {}
        self.in_memory = in_memory
        self._pool: list[np.ndarray] = []  # vectors of the pool not holding an update now
        self._budget = in_memory * 4 * self.served.size  # bytes of pending updates held in memory, at most
        self.held_bytes = 0  # the pool's vectors and the sparse updates held now
        self.spilled = 0  # updates written to a temporary file so far (how often the bound was reached)
        # held by the committer while it changes ``served``, and by the serving thread while it reads a pull's
        # rows from it: a pull sees every change committed before it whole, never a half-added one
        self.lock = threading.Lock()

    @property
    def pending_in_memory(self) -> int:
        """Whole-vector updates held in memory now (at most ``in_memory``)."""
        return sum(1 for v in self.pending.values() if v.dense is not None)

    @property
    def size(self) -> int:
        return int(self.served.size)

    def check(self, change: np.ndarray) -> np.ndarray:
        """``change``, if it has the vector's shape (``ValueError`` naming both sizes otherwise)."""
        if change.shape != self.served.shape:
            raise ValueError(f"a shared-parameter change of {change.size} values, but the shared parameters have "
                             f"{self.served.size} (trainers built with different models?)")
        return change

    def add(self, change: np.ndarray, rows: Optional[np.ndarray] = None) -> None:
        """Serve ``change`` from now on (a bucket's, or a sync's outside any bucket); ``rows``: a sparse change's
        relation rows (checked: ``RowLayout.check``), else a whole vector."""
        if rows is not None:
            self.layout.scatter_add(self.served, rows, change)
        else:
            self.served += self.check(change)

    def gather(self, rows: np.ndarray, into: np.ndarray) -> None:
        """The served values of a pull of ``rows`` into ``into``, with every committed change whole."""
        with self.lock:
            self.layout.gather(self.served, rows, into)

    def finish(self, bucket: Bucket, change: np.ndarray, saved: bool, rows: Optional[np.ndarray] = None) -> bool:
        """``bucket`` is done with ``change`` (already served; ``rows``: a sparse one's relation rows): stored now if it
        is ``saved`` (no partition of its own left to write), else pending until its write; whether ``stored``
        changed."""
        if rows is not None:
            if saved:
                self.layout.scatter_add(self.stored, rows, change)
                return True
            # kept as its rows and values (4 bytes a row and a value)
            rows32 = rows.astype(np.int32)
            update = Pending(rows=rows32, values=change.copy(), nbytes=4 * (rows.size + change.size))
            if self.held_bytes + update.nbytes <= self._budget:
                self.pending[bucket] = update
                self.held_bytes += update.nbytes
            else:  # beyond the bound: in a temporary file, a few hundred KB (not the whole vector)
                spill = tempfile.TemporaryFile()
                spill.write(rows32.tobytes() + np.ascontiguousarray(change, np.float32).tobytes())
                self.pending[bucket] = Pending(file=spill, rows=np.zeros(rows.size, np.int32), nbytes=0)
                self.spilled += 1
            return False
        elif saved:
            self.stored += change
            return True
        # by blocks of BLOCK values (a relation's row spans a few): which hold a non-zero value, found in well under
        # a millisecond where a scan for every non-zero value takes several
        whole = change.size - change.size % BLOCK
        blocks = np.flatnonzero(change[:whole].view(np.int32).reshape(-1, BLOCK).any(axis=1))
        sparse = blocks.size * (8 + 4 * BLOCK) + 4 * (change.size - whole)
        if sparse * SPARSE_BELOW < change.nbytes and self.held_bytes + sparse <= self._budget:
            # a few relations' rows (and their sums)
            self.pending[bucket] = Pending(index=blocks, values=change[:whole].reshape(-1, BLOCK)[blocks],
                                           tail=change[whole:].copy(), nbytes=sparse)
            self.held_bytes += sparse
        elif self._pool or self.held_bytes + change.nbytes <= self._budget:
            if not self._pool:  # allocated once, then reused: a fresh 12 MB copy costs page faults (~40 ms here)
                self._pool.append(np.empty_like(self.served))
                self.held_bytes += change.nbytes
            dense = self._pool.pop()
            np.copyto(dense, change)
            self.pending[bucket] = Pending(dense=dense)
        else:
            spill = tempfile.TemporaryFile()
            spill.write(np.ascontiguousarray(change, np.float32).tobytes())
            self.pending[bucket] = Pending(file=spill)
            self.spilled += 1
        return False

    def changed_blocks(self) -> Optional[VectorBlocks]:
        """The blocks of ``stored`` that differ from what the progress files hold, with their values now, taken as
        persisted from here on; None when they are more than a quarter of the vector (write it whole)."""
        whole = self.stored.size - self.stored.size % BLOCK
        now, before = self.stored.view(np.int32), self.persisted.view(np.int32)
        index = np.flatnonzero((now[:whole] != before[:whole]).reshape(-1, BLOCK).any(axis=1))
        np.copyto(self.persisted, self.stored)  # (the caller writes them, or the whole vector)
        if index.size * BLOCK * 4 > self.stored.size:
            return None
        return VectorBlocks(index, self.stored[:whole].reshape(-1, BLOCK)[index], self.stored[whole:].copy(), BLOCK)

    def save(self, unsaved: Collection[Bucket]) -> list[Bucket]:
        """Move the updates of the buckets saved now (pending, and no longer ``unsaved``) into ``stored``; those
        buckets (the shards of the vector save theirs too: job/train/distributed/shard_service.py)."""
        saved = [b for b in self.pending if b not in unsaved]
        for b in saved:
            update = self.pending.pop(b)
            if update.rows is not None:  # a sparse change's (in memory, or its file: rows then values)
                if update.file is not None:
                    update.file.seek(0)
                    raw = update.file.read()
                    update.file.close()
                    cut = 4 * update.rows.size
                    update.rows = np.frombuffer(raw[:cut], dtype=np.int32)
                    update.values = np.frombuffer(raw[cut:], dtype=np.float32)
                assert update.values is not None
                self.layout.scatter_add(self.stored, update.rows, update.values)
                self.held_bytes -= update.nbytes
            elif update.index is not None and update.values is not None and update.tail is not None:
                whole = self.stored.size - update.tail.size
                self.stored[:whole].reshape(-1, BLOCK)[update.index] += update.values
                self.stored[whole:] += update.tail
                self.held_bytes -= update.nbytes
            elif update.dense is not None:
                self.stored += update.dense
                self._pool.append(update.dense)
            elif update.file is not None:
                update.file.seek(0)
                self.stored += np.frombuffer(update.file.read(), dtype=np.float32)
                update.file.close()
        return saved


# a change whose blocks of BLOCK values holding a non-zero value (with their indices, and the few values after the
# last whole block) take less than 1/SPARSE_BELOW of its bytes is kept as those
SPARSE_BELOW = 8
BLOCK = 64


@dataclass
class Pending:
    """One bucket's update waiting for its save: by blocks (``index`` of the blocks, their ``values``, the ``tail``
    after the last whole block: ``nbytes`` in all), by relation ``rows`` (a sparse change: its ``values``, or with
    ``file``, both in it), whole
    (``dense``, a pool vector) or in a temporary ``file``."""

    index: Optional[np.ndarray] = None
    values: Optional[np.ndarray] = None
    tail: Optional[np.ndarray] = None
    nbytes: int = 0
    dense: Optional[np.ndarray] = None
    file: Optional[IO[bytes]] = None
    rows: Optional[np.ndarray] = None
