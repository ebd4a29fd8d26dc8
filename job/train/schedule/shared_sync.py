"""``SharedSync``: a torchrun group's parameter sync (job/train/schedule/interfaces.py): relation parameters, global
embeddings and unpartitioned tables pushed and pulled through the lock server of a ``LockServerScheduler``
(job/train/schedule/group.py) at every bucket boundary, and with ``shared_shards`` through the shards of the ranks
that serve each relation row (job/train/distributed/shard_routing.py)."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from job.train.distributed.shared_params import SharedParameters
from job.train.schedule.group import LockServerScheduler
from job.train.schedule.interfaces import ParameterSync

logger = logging.getLogger("biggraph")


class SharedSync(ParameterSync):
    """Push/pull through the lock server of ``scheduler`` (staleness: one bucket). At a bucket's end the change
    travels with the request that finishes the bucket (``LockServerScheduler.next_bucket``), so that the server
    stores the bucket as done and its shared update in one step (job/checkpoint/group_progress.py)."""

    def __init__(self, shared: SharedParameters, scheduler: LockServerScheduler) -> None:
        self.shared = shared
        self.scheduler = scheduler
        shared.shards = scheduler.shards.rows if scheduler.shards is not None else None

    def pull(self) -> None:
        if self.shared.shards is not None:  # each row from its shard (loaded for the pass: start_pass)
            self.shared.gather_all(self.scheduler.client)
        else:
            self.shared.assign(self.scheduler.client.sync(self.shared.no_change()))

    def prepare(self, edges: Any) -> None:
        """The bucket's edges are read: take the group's values of the relation rows they name (the others may stay
        stale, nothing reads them: ``SharedParameters.pull``)."""
        if self.scheduler.current is not None:
            self.shared.pull(self.scheduler.client, edges.rel)

    def sync(self) -> None:
        if self.scheduler.current is not None:
            self.scheduler.carry = self.shared
        else:
            self.shared.sync(self.scheduler.client)

    def settle(self) -> None:
        server = self.scheduler.server
        if server is not None:
            values = self.shared.settle(server.values())
            if self.shared.shards is not None:
                # every bucket is saved at the pass's end, and nothing but buckets changed the vector since the last
                # whole sync: what the last record persisted is what the group serves (shards included), or a
                # shard's save went missing
                gap = float(np.abs(server.vector.stored - values.numpy()).max(initial=0.0))
                logger.info("rank 0: shared shards: the persisted shared vector differs from the served one by at "
                            "most %.3g at the pass's end", gap, extra={"fields": {"shared_stored_gap": gap}})
