"""``SharedVector``: the shared parameters as the lock server holds them, and which bucket's change a restart keeps.

A ``next`` carries the trainer's change since its last sync for the bucket it finishes; the server adds it to the
vector it serves (``served``) and answers with the sum. What it persists (``stored``) holds the change of a bucket
only once the bucket is done *and* its partitions are written: until then a restart redoes the bucket
(``LockState.forget_rank_locks``), so its change waits in ``pending`` and enters ``stored`` with the record that
saves the bucket. A restart thus resumes with every saved bucket's shared update once and without any bucket it
redoes (docs/ARCHITECTURE.md, invariants; docs/design/distributed.md, "Shared parameters across a restart").

Memory: ``served``, ``stored`` and at most ``PENDING_VECTORS`` pending updates (job/train/residency/budget.py,
counted in ``memory_budget``); a group with more buckets done but unsaved at once (many pods, each holding a
partition across buckets) keeps the others in local temporary files until their buckets are saved. They are never
needed after a restart (which redoes unsaved buckets), so the files are unnamed and go with the process.
"""

from __future__ import annotations

import tempfile
from collections.abc import Collection
from typing import IO, Union

import numpy as np

from job.train.residency.budget import PENDING_VECTORS
from job.types import Bucket


class SharedVector:
    """The served, stored and pending parts of the shared-parameter vector (float32, one flat vector)."""

    def __init__(self, initial: np.ndarray, in_memory: int = PENDING_VECTORS) -> None:
        self.served = initial.astype(np.float32, copy=True)
        self.stored = self.served.copy()  # the updates of the buckets done and saved: what a restart resumes
        # the update of each bucket done but not yet saved: in memory, or (beyond ``in_memory``) in a temporary file
        self.pending: dict[Bucket, Union[np.ndarray, IO[bytes]]] = {}
        self.in_memory = in_memory
        self.spilled = 0  # updates written to a temporary file so far (how often the bound was reached)

    @property
    def pending_in_memory(self) -> int:
        return sum(1 for v in self.pending.values() if isinstance(v, np.ndarray))

    @property
    def size(self) -> int:
        return int(self.served.size)

    def check(self, change: np.ndarray) -> np.ndarray:
        """``change``, if it has the vector's shape (``ValueError`` naming both sizes otherwise)."""
        if change.shape != self.served.shape:
            raise ValueError(f"a shared-parameter change of {change.size} values, but the shared parameters have "
                             f"{self.served.size} (trainers built with different models?)")
        return change

    def add(self, change: np.ndarray) -> None:
        """Serve ``change`` from now on (a bucket's, or a sync's outside any bucket)."""
        self.served += self.check(change)

    def finish(self, bucket: Bucket, change: np.ndarray, saved: bool) -> bool:
        """``bucket`` is done with ``change`` (already served): stored now if it is ``saved`` (no partition of its
        own left to write), else pending until its write; whether ``stored`` changed."""
        if saved:
            self.stored += change
            return True
        if self.pending_in_memory < self.in_memory:
            self.pending[bucket] = change.copy()
        else:
            spill = tempfile.TemporaryFile()
            spill.write(np.ascontiguousarray(change, np.float32).tobytes())
            self.pending[bucket] = spill
            self.spilled += 1
        return False

    def save(self, unsaved: Collection[Bucket]) -> bool:
        """Move the updates of the buckets saved now (pending, and no longer ``unsaved``) into ``stored``; whether
        there were any."""
        saved = [b for b in self.pending if b not in unsaved]
        for b in saved:
            update = self.pending.pop(b)
            if isinstance(update, np.ndarray):
                self.stored += update
            else:
                update.seek(0)
                self.stored += np.frombuffer(update.read(), dtype=np.float32)
                update.close()
        return bool(saved)
