"""The lock server's side of the shared-parameter transfers: which waiting request's payload is received next, what
a transfer's end means, and a peer treated as gone. A base class of ``LockServer`` (through ``PullServing``,
job/train/distributed/lock_server.py), whose attributes below are the server's; the transfers themselves:
job/train/distributed/transfers.py.

Why apart: ``_dispatch`` runs after every batch of events the serving thread handles, over every request still
waiting for a buffer. At 128 pods dozens of pulls wait for the sparse buffers' bound at once; asking for a buffer
for each of them after every event was ~30% of the serving thread's time (issue #45, bench/RESULTS.md "The lock
server's serving thread: the dispatch"). Now a kind of buffer refused once in a scan is not asked for again in that
scan (the requests behind it keep their turn), and the scan runs once per batch of events.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Optional

import torch

from job.train.distributed.protocol import LockServerError, ProtocolError
from job.train.distributed.shared_vector import SharedVector
from job.train.distributed.transfers import Flight, Flights, TransferSlots, Waiting
from job.train.distributed.transport import TensorTransport, TransferError

logger = logging.getLogger("biggraph")

__all__ = ["TransferServing"]


class TransferServing:
    """How ``LockServer`` starts, ends and gives up transfers (see the module docstring)."""

    vector: SharedVector
    transport: TensorTransport
    _slots: TransferSlots
    _flights: Flights
    _waiting: deque[Waiting]
    _gone: dict[int, str]
    _sums: dict[int, list]
    _drain_limit: int
    _dispatch_due: bool

    def _judge(self, job: Waiting, buffer: Optional[torch.Tensor] = None, slot: bool = False,
               pull_into: Optional[torch.Tensor] = None) -> None:
        raise NotImplementedError

    def _refuse(self, job: Waiting, err: BaseException) -> None:
        raise NotImplementedError

    def _dispatch_pull(self, job: Waiting) -> bool:
        raise NotImplementedError

    def _dispatch(self) -> None:
        """Start the receive of every waiting request whose peer has no transfer in flight, while buffers last (a
        pull is judged once its values' buffer is free). First come, first served: once a slot, or a sparse buffer,
        is refused, the later requests needing one wait for the next scan without asking."""
        self._dispatch_due = False
        slots_full = sparse_full = False
        kept: deque[Waiting] = deque()
        waiting, self._waiting = self._waiting, kept
        size = self.vector.size
        for job in waiting:
            if job.rank in self._gone:
                self._refuse(job, LockServerError(f"rank {job.rank} is treated as gone ({self._gone[job.rank]})"))
                continue
            payload = job.incoming.envelope.payload
            sparse = payload is None or (payload.values < size and "rows" in job.incoming.fields)
            dense = payload is not None and payload.values == size
            if (sparse and sparse_full) or (dense and slots_full) or self._flights.busy(job.rank):
                kept.append(job)  # (busy: its sum not yet reported taken; a correct client asks again only after)
                continue
            if payload is None:  # a pull: its values leave from a buffer of their own once it is judged
                if not self._dispatch_pull(job):
                    sparse_full = True
                    kept.append(job)
                continue
            values, tag = payload.values, payload.tag
            if values > self._drain_limit:  # no buffer is sized from what a peer claims: refused unreceived, and its
                # transfer pair is left unusable, so the rank is treated as gone
                why = f"it announced a change of {values} values (the shared parameters have {size})"
                self._lose(job.rank, why)
                self._refuse(job, ProtocolError(why))
                continue
            taken: Optional[torch.Tensor]
            if dense:
                taken, is_slot = self._slots.take(), True
                slots_full = taken is None
            elif sparse:  # a sparse change
                taken, is_slot = self._slots.take_sparse(values), False
                sparse_full = taken is None
            else:  # taken only to be refused, so that its sender is not left waiting (at most the vector's size:
                # ``read_incoming`` refuses a larger announcement)
                taken, is_slot = torch.empty(values, dtype=torch.float32), False
            if taken is None:
                kept.append(job)  # every slot held, or the sparse buffers' bound reached: it waits for one
                continue
            try:
                transfer = self.transport.recv_async(taken, job.rank, tag)
            except Exception as err:  # noqa: BLE001 - a TransferError, or gloo refusing the peer: answered
                self._slots.settle(is_slot, taken, well=False)
                self._lose(job.rank, str(err))
                self._refuse(job, err)
                continue
            self._flights.start("receive", job, taken, is_slot, transfer)

    def _on_ended(self, flight: Flight, error: Optional[str]) -> None:
        """A transfer ended: judge the request whose change arrived and send its sum, or note a failure."""
        self._flights.end(flight)
        job = flight.job
        if error is not None:
            self._settle(flight.slot, flight.buffer, well=False)
            if not flight.overdue:  # an overdue one was reported at its deadline
                self._lose(job.rank, error)
                if flight.kind == "receive":
                    self._refuse(job, TransferError(error))
        elif flight.kind == "receive" and not flight.overdue:
            self._judge(job, flight.buffer, flight.slot)  # the slot is given back once its change is added
        else:  # a sum taken, or a transfer done after its deadline (its peer counted gone already)
            self._settle(flight.slot, flight.buffer, well=True)
        self._dispatch_due = True

    def _settle(self, is_slot: bool, buffer: torch.Tensor, well: bool) -> None:
        """A transfer's buffer is done with; a batch's sum only once every send of it has ended."""
        shared = self._sums.get(id(buffer))
        if shared is None:
            self._slots.settle(is_slot, buffer, well=well)
            return
        shared[0] -= 1
        shared[2] = shared[2] or not well
        if shared[0] <= 0:
            del self._sums[id(buffer)]
            self._slots.settle(shared[1], buffer, well=not shared[2])

    def _expire(self, now: float) -> None:
        """Transfers past the transport's timeout: their peers are gone (their buffers stay until gloo ends them)."""
        late = self._flights.overdue(now)
        for flight in late:
            verb = "not received" if flight.kind == "receive" else "not taken"
            why = f"{flight.transfer.what}: {verb} in {self._flights.timeout_s:.0f} s"
            self._lose(flight.job.rank, why)
            if flight.kind == "receive":
                self._refuse(flight.job, TransferError(why))
        if late:
            self._dispatch_due = True

    def _lose(self, rank: int, why: str) -> None:
        if rank not in self._gone:
            self._gone[rank] = why
            logger.warning("lock server: the shared parameters did not reach rank %d or come from it (%s); it is "
                           "treated as gone, its requests refused", rank, why)
