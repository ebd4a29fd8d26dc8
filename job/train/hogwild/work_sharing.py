"""The batches of a delayed Hogwild slice, shared so that any worker can take them.

PBG's ``hogwild_delay`` holds every Hogwild worker but the first back on each bucket of epoch 0, and PBG's
held workers idle. Here a held slice's batches are numbered by its plan (``batching.plan_batches``, a
function of the slice and its seed), its owner takes them from the front once its delay is over, and any
worker that has finished its own slice takes them from the back. Each batch runs once, the same batches as
PBG's, and during the delay one worker trains alone, which is the delay's purpose.

The owner plans during its delay and publishes the plan here, so a worker taking batches from the back need
not plan again; if it gets there first, it plans the slice itself (the same plan, from the same seed).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any, Optional

import torch
from torch import Tensor

from job.train.batch.batching import BatchPlan, plan_batches

FRONT, BACK, NUM_BATCHES, PUBLISHED = range(4)


@dataclass
class SharedSlice:
    """A delayed slice in shared memory: its seed and edges, room for its plan, and who took what.

    ``counters``: batches taken from the front, taken from the back, the plan's batch count and whether the
    plan is published, read and written under the pool's lock. A multiprocessing lock reaches a worker only
    by inheritance, not in a task: each worker attaches its own handle (``with_lock``)."""

    indices: Tensor
    seed: int
    counters: Tensor
    plan_indices: Tensor
    plan_table: Tensor  # (max batches, 3): relation, start, end of each batch
    lock: Any = None

    @staticmethod
    def allocate(indices: Tensor, seed: int, batch_size: int, num_relations: int) -> SharedSlice:
        """Room for any plan of ``indices``: at most one partial batch per relation beyond the full ones."""
        max_batches = -(-indices.numel() // max(batch_size, 1)) + num_relations
        return SharedSlice(indices.share_memory_(), seed, torch.zeros(4, dtype=torch.long).share_memory_(),
                           torch.empty_like(indices).share_memory_(),
                           torch.empty(max_batches, 3, dtype=torch.long).share_memory_())

    def with_lock(self, lock: Any) -> SharedSlice:
        return replace(self, lock=lock)

    def publish(self, plan: BatchPlan) -> None:
        n = plan.num_batches
        if n > self.plan_table.shape[0] or plan.indices.numel() != self.plan_indices.numel():
            return  # cannot happen by allocate's bound; the other workers then plan for themselves
        self.plan_indices.copy_(plan.indices)
        self.plan_table[:n, 0] = plan.relations
        self.plan_table[:n, 1] = plan.starts
        self.plan_table[:n, 2] = plan.ends
        with self.lock:
            self.counters[NUM_BATCHES] = n
            self.counters[PUBLISHED] = 1

    def plan(self, rel: Tensor, batch_size: int, dynamic: bool) -> BatchPlan:
        """The owner's plan: the published one, or the same computed here from the slice's seed."""
        with self.lock:
            published = bool(self.counters[PUBLISHED])
            n = int(self.counters[NUM_BATCHES])
        if not published:
            return plan_batches(rel, self.indices, batch_size, dynamic, torch.Generator().manual_seed(self.seed))
        table = self.plan_table[:n]
        return BatchPlan(self.plan_indices, table[:, 0], table[:, 1], table[:, 2], dynamic)

    def claim(self, num_batches: int, from_back: bool) -> Optional[int]:
        """The number of the next batch to run, or None when every batch of the slice is taken."""
        with self.lock:
            front, back = int(self.counters[FRONT]), int(self.counters[BACK])
            if front + back >= num_batches:
                return None
            self.counters[BACK if from_back else FRONT] += 1
            return num_batches - 1 - back if from_back else front

    def claims(self, num_batches: int, from_back: bool) -> Iterator[int]:
        while (k := self.claim(num_batches, from_back)) is not None:
            yield k

    def exhausted(self) -> bool:
        """Whether the published plan's batches are all taken (False before it is published)."""
        with self.lock:
            return bool(self.counters[PUBLISHED]) and int(self.counters[FRONT] + self.counters[BACK]) >= int(
                self.counters[NUM_BATCHES])
