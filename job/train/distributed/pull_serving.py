"""A trainer's pull of the rows its bucket reads (issue #45), on the lock server's side: a base class of
``LockServer`` (job/train/distributed/lock_server.py), whose attributes below are the server's.

Why a pull: a sparse ``next`` carries only the rows a bucket changed and takes nothing back; before its next bucket
trains, the trainer asks for the current values of the relation rows that bucket's edges name (and the vector's
whole part), and the rows it does not read may stay stale (job/train/distributed/shared_params.py). The values are
read from the served vector under its lock (never a change half added) and sent after the reply, from a sparse
buffer of their own (``TransferSlots.take_sparse``: bounded, counted in ``memory_budget``), under the request's tag.
"""

from __future__ import annotations

import numpy as np
import torch

from job.train.distributed import protocol
from job.train.distributed.protocol import Reply
from job.train.distributed.shared_rows import RowLayout
from job.train.distributed.shared_vector import SharedVector
from job.train.distributed.transfer_serving import TransferServing
from job.train.distributed.transfers import Flights, TransferSlots, Waiting
from job.train.distributed.transport import TensorTransport, TransferError


class PullServing(TransferServing):
    """How ``LockServer`` serves pulls (see the module docstring)."""

    layout: RowLayout
    vector: SharedVector
    transport: TensorTransport
    _slots: TransferSlots
    _flights: Flights

    def _push(self, job: Waiting, reply: Reply) -> None:
        raise NotImplementedError

    def _dispatch_pull(self, job: Waiting) -> bool:
        """Judge a waiting pull if a buffer for its values is free (whether it left the queue)."""
        rows = job.incoming.fields.get("rows")
        count = len(rows) if isinstance(rows, list) else 0
        if count > self.layout.rows:  # more rows than there are: refused by its check, no buffer sized from it
            self._judge(job, None)
            return True
        buffer = self._slots.take_sparse(self.layout.count(count))
        if buffer is None:
            return False
        self._judge(job, None, pull_into=buffer)
        return True

    def _send_pull(self, job: Waiting, rows: np.ndarray, buffer: torch.Tensor, tag: int) -> None:
        """Answer a pull, then send it the served values of ``rows`` (read now) under its ``tag``."""
        self.vector.gather(rows, buffer.numpy())
        self._push(job, protocol.Done())
        try:
            transfer = self.transport.send(buffer, job.rank, tag)
        except TransferError as err:
            self._slots.settle(False, buffer, well=False)
            self._lose(job.rank, str(err))
        else:
            self._flights.start("send", job, buffer, False, transfer)


__all__ = ["PullServing"]
