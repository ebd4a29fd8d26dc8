"""``SharedVector``: the shared parameters as the lock server holds them, and which bucket's change a restart keeps.

A ``next`` carries the trainer's change since its last sync for the bucket it finishes; the server adds it to the
vector it serves (``served``) and answers with the sum. What it persists (``stored``) holds the change of a bucket
only once the bucket is done *and* its partitions are written: until then a restart redoes the bucket
(``LockState.forget_rank_locks``), so its change waits in ``pending`` and enters ``stored`` with the record that
saves the bucket. A restart thus resumes with every saved bucket's shared update once and without any bucket it
redoes (docs/ARCHITECTURE.md, invariants; docs/design/distributed.md, "Shared parameters across a restart").
"""

from __future__ import annotations

from collections.abc import Collection

import numpy as np

from job.types import Bucket


class SharedVector:
    """The served, stored and pending parts of the shared-parameter vector (float32, one flat vector)."""

    def __init__(self, initial: np.ndarray) -> None:
        self.served = initial.astype(np.float32, copy=True)
        self.stored = self.served.copy()  # the updates of the buckets done and saved: what a restart resumes
        self.pending: dict[Bucket, np.ndarray] = {}  # the update of each bucket done but not yet saved

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
        self.pending[bucket] = change.copy()
        return False

    def save(self, unsaved: Collection[Bucket]) -> bool:
        """Move the updates of the buckets saved now (pending, and no longer ``unsaved``) into ``stored``; whether
        there were any."""
        saved = [b for b in self.pending if b not in unsaved]
        for b in saved:
            self.stored += self.pending.pop(b)
        return bool(saved)
