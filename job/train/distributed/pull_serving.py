"""A trainer's pull of the rows its bucket reads (issue #45), on the lock server's side: a base class of
``LockServer`` (job/train/distributed/lock_server.py), whose attributes below are the server's.

Why a pull: a sparse ``next`` carries only the rows a bucket changed and takes nothing back; before its next bucket
trains, the trainer asks for the current values of the relation rows that bucket's edges name (and the vector's
whole part), and the rows it does not read may stay stale (job/train/distributed/shared_params.py). The values are
read from the served vector under its lock (never a change half added) and sent after the reply, from a sparse
buffer of their own (``TransferSlots.take_sparse``: bounded, counted in ``memory_budget``), under the request's tag.

The read is done by a thread of its own (``Gatherer``), not by the serving thread: it waits for the vector's lock,
which the committer holds while it adds changes (the serving thread spent ~1-4 ms of wall a pull there at 128
pods, answering nobody meanwhile), and numpy copies the rows without the GIL. Once read, the serving thread answers
and posts the send (``("gathered", ...)`` in its inbox): every transfer is still posted by the serving thread. The
values read are those served when the read happens, later than the pull was judged: every change whose reply the
trainer had before it pulled is in them, as before.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, Optional

import numpy as np
import torch

from job.train.distributed import protocol
from job.train.distributed.protocol import Reply
from job.train.distributed.shared_rows import RowLayout
from job.train.distributed.shared_vector import SharedVector
from job.train.distributed.transfer_serving import TransferServing
from job.train.distributed.transfers import Flights, TransferSlots, Waiting
from job.train.distributed.transport import TensorTransport, TransferError

logger = logging.getLogger("biggraph")


class PullServing(TransferServing):
    """How ``LockServer`` serves pulls (see the module docstring)."""

    _gatherer: Gatherer

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
        """Have the served values of ``rows`` read into ``buffer`` off this thread; ``_on_gathered`` then answers."""
        self._gatherer.submit((job, rows, buffer, tag))

    def _on_gathered(self, job: Waiting, buffer: torch.Tensor, tag: int, error: Optional[str]) -> None:
        """A pull's values are read: answer it, then send them under its ``tag``."""
        if error is not None:
            self._slots.settle(False, buffer, well=True)
            self._refuse(job, RuntimeError(f"its rows could not be read: {error}"))
            return
        self._push(job, protocol.Done())
        try:
            transfer = self.transport.send(buffer, job.rank, tag)
        except TransferError as err:
            self._slots.settle(False, buffer, well=False)
            self._lose(job.rank, str(err))
        else:
            self._flights.start("send", job, buffer, False, transfer)


class Gatherer:
    """One thread reading pulls' rows from ``vector`` (under its lock), each reported as ``("gathered", job,
    buffer, tag, error or None)`` through ``done``, in the order submitted."""

    def __init__(self, vector: SharedVector, done: Callable[[tuple], None]) -> None:
        self.vector = vector
        self._done = done
        self._queue: queue.SimpleQueue[Optional[tuple[Any, np.ndarray, torch.Tensor, int]]] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="biggraph-lock-pulls", daemon=True)
        self.thread.start()

    def submit(self, pull: tuple[Any, np.ndarray, torch.Tensor, int]) -> None:
        self._queue.put(pull)

    def stop(self) -> None:
        self._queue.put(None)
        self.thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            pull = self._queue.get()
            if pull is None:
                return
            job, rows, buffer, tag = pull
            error: Optional[str] = None
            try:
                self.vector.gather(rows, buffer.numpy())
            except Exception as err:  # noqa: BLE001 - the pull is refused with it
                logger.exception("lock server: a pull's rows could not be read")
                error = f"{type(err).__name__}: {err}"
            self._done(("gathered", job, buffer, tag, error))


__all__ = ["Gatherer", "PullServing"]
