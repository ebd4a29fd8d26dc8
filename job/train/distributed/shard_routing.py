"""A trainer's shared rows routed to the ranks that serve them (``shared_shards``, issue #45): relation row r to rank
r mod M's shard (job/train/distributed/shard_service.py), the vector's whole part and rank 0's rows to the lock server
as before.

- A bucket's change (``SharedParameters.outgoing``, always sparse with shards): each other owner's rows are pushed to
  its shard under the bucket and acknowledged *before* the ``next`` that finishes the bucket carries rank 0's part
  (``push``), so that rank 0 never counts a bucket done whose update a shard lacks.
- A bucket's pull: rank 0's part (the whole values and its rows) from the lock server, each other owner's rows from
  its shard (``pull``).
- A whole sync (a pass's end; rank 0's settle): the change of the rows others serve goes to them outside any bucket,
  the rest to rank 0 as a dense sync with those rows zeroed, and the sum's values of those rows come from their shards
  (``fill``): rank 0 still serves its copy of them, but only as it was when the pass started.
- ``GroupShards``: one rank's part in a round: its shard (none on rank 0, whose rows are its server's), loaded from rank
  0's served vector at each pass's start, and the clients that ask the shards.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from job.errors import ConfigError
from job.train.distributed.lock_client import LockClient
from job.train.distributed.shard_client import ShardClient
from job.train.distributed.shard_service import ShardService, ShardSlice, owned_rows, set_rows
from job.train.distributed.shared_rows import RowLayout
from job.types import Bucket


def shardable(layout: Optional[RowLayout]) -> RowLayout:
    """``layout``, if it has relation rows to shard; else the config error (exit 2) naming the keys."""
    if layout is None or layout.rows == 0:
        raise ConfigError("config key 'shared_shards': the model's shared parameters have no relation rows to shard "
                          "(it needs dynamic_relations: true and relation operators with parameters); set "
                          "shared_shards: false")
    return layout


class ShardedRows:
    """Where each relation row of ``layout`` is served in a round of ``world_size`` ranks, and the traffic to get there."""

    def __init__(self, client: ShardClient, layout: RowLayout, world_size: int) -> None:
        self.client = client
        self.layout = layout
        self.world_size = world_size
        self.pass_tag = ""  # the pass the shards serve now (``GroupShards.start_pass``)
        self._all = np.arange(layout.rows, dtype=np.int64)

    def owners(self, rows: np.ndarray) -> np.ndarray:
        return rows % self.world_size

    def push(self, bucket: Optional[Bucket], values: torch.Tensor,
             rows: np.ndarray) -> tuple[torch.Tensor, np.ndarray]:
        """Push the parts of a sparse change (``values``: its payload, naming ``rows``) that other ranks serve, under
        ``bucket`` (None: outside any bucket); rank 0's part (the whole values and its rows), to send with ``next``."""
        whole = self.layout.whole_values
        by_row = values[whole:].reshape(rows.size, self.layout.row_values).numpy()
        owner = self.owners(rows)
        requests = {int(o): (rows[owner == o], by_row[owner == o].reshape(-1)) for o in np.unique(owner) if o != 0}
        if requests:
            self.client.exchange("push", self.pass_tag, requests, bucket)
        mine = owner == 0
        return torch.cat([values[:whole], torch.from_numpy(by_row[mine].reshape(-1))]), rows[mine]

    def pull(self, lock_client: LockClient, rows: np.ndarray) -> torch.Tensor:
        """The current values of the whole part and of ``rows`` (ascending): a sparse payload naming them."""
        whole, width = self.layout.whole_values, self.layout.row_values
        owner = self.owners(rows)
        mine = owner == 0
        own = rows[mine]
        ours = lock_client.pull(own.tolist(), torch.empty(self.layout.count(own.size)))
        out = np.empty(self.layout.count(rows.size), np.float32)
        out[:whole] = ours[:whole].numpy()
        by_row = out[whole:].reshape(rows.size, width)
        by_row[mine] = ours[whole:].numpy().reshape(-1, width)
        none = np.zeros(0, np.float32)
        requests = {int(o): (rows[owner == o], none) for o in np.unique(owner) if o != 0}
        for shard, reply in (self.client.exchange("pull", self.pass_tag, requests) if requests else {}).items():
            by_row[owner == shard] = reply.values.reshape(-1, width)
        return torch.from_numpy(out)

    def others(self) -> np.ndarray:
        """Every row another rank serves."""
        return self._all[self.owners(self._all) != 0]

    def fill(self, vector: np.ndarray) -> None:
        """Every row another rank serves, its served values into ``vector`` (a whole one)."""
        rows = self._all
        owner = self.owners(rows)
        none = np.zeros(0, np.float32)
        requests = {shard: (rows[owner == shard], none) for shard in range(1, self.world_size)}
        for shard, reply in self.client.exchange("pull", self.pass_tag, requests).items():
            set_rows(self.layout, vector, rows[owner == shard], reply.values)

    def zero_others(self, vector: np.ndarray) -> None:
        """The rows other ranks serve set to zero in ``vector`` (a dense change to rank 0 that leaves them be)."""
        rows = self.others()
        set_rows(self.layout, vector, rows, np.zeros(rows.size * self.layout.row_values, np.float32))

    def push_outside(self, current: np.ndarray, synced: np.ndarray) -> None:
        """A whole sync's change of the rows other ranks serve (``current`` - ``synced``, where they differ) to them."""
        rows = self.layout.differing(current, synced)
        rows = rows[self.owners(rows) != 0]
        if not rows.size:
            return
        now, before = np.empty(self.layout.count(rows.size), np.float32), np.empty(self.layout.count(rows.size),
                                                                                   np.float32)
        self.layout.gather(current, rows, now)
        self.layout.gather(synced, rows, before)
        self.push(None, torch.from_numpy(now - before), rows)[0]  # (rank 0's part: none, these rows are others')


class GroupShards:
    """One rank's shards in a round (see the module docstring): its ``service`` (None on rank 0), the trainer's
    ``rows`` routing, and a saver per pass for rank 0's committer."""

    def __init__(self, ctx: Any, layout: RowLayout) -> None:
        self.rank, self.world_size = ctx.rank, ctx.world_size
        self.layout = layout
        self._ctx = ctx
        self.service: Optional[ShardService] = None
        if ctx.rank != 0:
            self.service = ShardService(ShardSlice(rank=ctx.rank, world_size=ctx.world_size, layout=layout),
                                        round_id=ctx.round_id, store=ctx.store, key=ctx.key)
            self.service.start()
        self.rows = ShardedRows(self._client(), layout, ctx.world_size)
        self._saver: Optional[ShardClient] = None

    def _client(self) -> ShardClient:
        return ShardClient(rank=self.rank, world_size=self.world_size, round_id=self._ctx.round_id,
                           store=self._ctx.store, key=self._ctx.key,
                           limit=self.layout.rows * (1 + self.layout.row_values) + 1024)

    def start_pass(self, pass_tag: str, lock_client: LockClient) -> None:
        """A pass starts (rank 0's server made): this rank's shard takes its rows' values as rank 0 serves them now."""
        self.rows.pass_tag = pass_tag
        if self.service is None:
            return
        rows = owned_rows(self.rank, self.world_size, self.layout.rows)
        pulled = lock_client.pull(rows.tolist(), torch.empty(self.layout.count(rows.size)))
        self.service.shard.load(pass_tag, pulled[self.layout.whole_values:].numpy())

    def saver(self, pass_tag: str) -> Any:
        """Rank 0: what its committer calls when a record saves buckets (a client of its own: another thread)."""
        if self._saver is not None:
            self._saver.close()
        client = self._saver = self._client()
        return lambda buckets: client.save(pass_tag, buckets)

    def bytes_through(self) -> int:
        """Payload bytes this rank's shard clients and shard moved (both ways)."""
        total = self.rows.client.traffic.sent + self.rows.client.traffic.received
        if self._saver is not None:
            total += self._saver.traffic.sent + self._saver.traffic.received
        if self.service is not None:
            total += self.service.shard.stats.bytes_in + self.service.shard.stats.bytes_out
        return total

    def close(self) -> None:
        self.rows.client.close()
        if self._saver is not None:
            self._saver.close()
        if self.service is not None:
            self.service.close()
