"""The lock server's shared-parameter transfers in flight: posted, completed off the serving thread, never waited on.

Why: the server (job/train/distributed/lock_server.py) is one thread serving every rank. When it waited for a peer to send a
change or take a sum, a frozen (SIGSTOPped) peer held it, and so every other rank, for the transfer's whole
timeout. Here a transfer is posted and a small thread of its own waits on it (``Transfer.wait_unbounded``: gloo's
own timeout would close every pair of the group, job/train/distributed/transport.py) and reports its end to the server's
inbox, so the serving thread only ever waits on its inbox. The server applies the timeout itself
(``overdue``): a transfer past it makes its peer gone. The waiting threads are reused (``Flights``: a transfer goes
to an idle one, and a new one starts only when none is idle, so that a frozen peer's transfer never holds up
another's): starting a thread per transfer cost the serving thread ~0.16 ms of wall time each on a quiet machine and
~1 ms under load, two transfers a bucket (issue #45, bench/RESULTS.md "The lock server's serving thread").

Memory: a transfer needs a vector of the shared parameters' size (the change arrives into it, the sum leaves from
it: a copy of the served vector, since that one changes with the next request while the peer may not have taken
the sum yet). These come from ``TransferSlots``: at most ``TRANSFER_SLOTS`` at once, allocated when first needed,
counted in ``sync_memory_bytes`` (job/train/distributed/lock_server.py) and so in ``memory_budget``. A peer has at most one
transfer in flight (its change, then its sum, in the same slot): a correct client asks again only after it took its
sum. A payload request that finds its peer's slot still busy, or no slot free, waits in the server's queue; the
other ranks' requests are served meanwhile. A slot whose transfer is overdue stays held, and counted, until gloo
lets its buffer go (the peer thaws and takes it, or its socket closes); one whose transfer failed is not reused
(a fresh one is made when needed).
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from job.train.distributed import protocol
from job.train.distributed.protocol import Incoming
from job.train.distributed.transport import Transfer, TransferError
from job.train.residency.budget import SPARSE_TRANSFER_VECTORS, TRANSFER_SLOTS


class TransferSlots:
    """Up to ``limit`` vectors of ``values`` float32s, allocated when first needed and reused after a transfer
    that ended well; one given up (``retire``) frees its place only once its transfer has ended."""

    def __init__(self, values: int, limit: int = TRANSFER_SLOTS, sparse_vectors: int = SPARSE_TRANSFER_VECTORS) -> None:
        self.values = values
        self.limit = limit
        self._free: list[torch.Tensor] = []
        self.held = 0  # slots in use or retired but still in gloo's hands
        # sparse payloads (a bucket's rows, a pull's): buffers of their own size, ``sparse_limit`` values in all
        self.sparse_limit = sparse_vectors * values
        self.sparse_held = 0
        self._sparse: set[int] = set()  # ids of the sparse buffers held

    def take_sparse(self, values: int) -> Optional[torch.Tensor]:
        """A buffer of ``values`` for a sparse payload, or None while the sparse ones held leave no room (one at a
        time always fits: a sparse payload is at most the vector's size)."""
        if self.sparse_held and self.sparse_held + values > self.sparse_limit:
            return None
        buffer = torch.empty(values, dtype=torch.float32)
        self.sparse_held += values
        self._sparse.add(id(buffer))
        return buffer

    def take(self) -> Optional[torch.Tensor]:
        """A free slot, or None when ``limit`` are held."""
        if self._free:
            self.held += 1
            return self._free.pop()
        if self.held >= self.limit:
            return None
        self.held += 1
        return torch.empty(self.values, dtype=torch.float32)

    def give_back(self, slot: torch.Tensor) -> None:
        """A slot whose transfer ended well: reused by the next transfer."""
        self.held -= 1
        self._free.append(slot)

    def settle(self, is_slot: bool, buffer: torch.Tensor, well: bool) -> None:
        """A transfer's buffer is done with: a slot goes back (``well``) or is dropped (its transfer may still hold
        it); a buffer that was never a slot is simply let go."""
        if is_slot:
            if well:
                self.give_back(buffer)
            else:
                self.drop()
        elif id(buffer) in self._sparse:  # (one whose transfer failed too: gloo is done with it once it ended)
            self._sparse.discard(id(buffer))
            self.sparse_held -= buffer.numel()

    def drop(self) -> None:
        """A slot whose transfer failed: its buffer is let go (gloo is done with it) and a fresh one may be made."""
        self.held -= 1

    @property
    def allocated(self) -> int:
        """Vectors alive now (held or free): never above ``limit``."""
        return self.held + len(self._free)


@dataclass
class Waiting:
    """A request that carries a payload, waiting for its transfer to start (its peer busy, or no slot free)."""

    incoming: Incoming
    rank: int
    reply_to: str
    typed: Any = None  # the request decoded on the reader thread, or the ProtocolError its fields raised
    marks: Optional[dict[str, float]] = None  # where its round trip went, when traced (request_trace.py)

    def request(self) -> protocol.Request:
        if isinstance(self.typed, protocol.ProtocolError):
            raise self.typed
        return self.typed if self.typed is not None else protocol.decode_request(self.incoming)


@dataclass
class Flight:
    """A transfer in flight: the receive of a request's change, or the send of its sum (``kind``)."""

    kind: str  # "receive" | "send"
    job: Waiting
    buffer: torch.Tensor
    slot: bool  # whether ``buffer`` is one of the slots (a change of the wrong size gets a buffer of its own)
    transfer: Transfer
    deadline: float
    ticket: int
    overdue: bool = False  # past its deadline: its peer is gone, the buffer kept until gloo lets it go


@dataclass
class Flights:
    """The transfers in flight, one at most per rank, each waited on by a thread that reports its end into
    ``inbox`` as ``("ended", flight, error or None)``: an idle waiter of earlier transfers, else a new one (an idle
    waiter ends after ``IDLE_S``; ``close`` ends them all)."""

    inbox: "queue.Queue[Any]"
    timeout_s: float
    by_rank: dict[int, Flight] = field(default_factory=dict)
    _tickets: itertools.count = field(default_factory=itertools.count)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _posted: "queue.Queue[Optional[Flight]]" = field(default_factory=queue.Queue)  # to the waiters
    _idle: int = 0  # waiters free to take a posted flight (each posted one claims one, or starts a new waiter)
    waiters: int = 0  # waiter threads alive (tests)

    IDLE_S = 30.0

    def start(self, kind: str, job: Waiting, buffer: torch.Tensor, slot: bool, transfer: Transfer) -> Flight:
        flight = Flight(kind, job, buffer, slot, transfer, time.monotonic() + self.timeout_s, next(self._tickets))
        with self._lock:
            self.by_rank[job.rank] = flight
            self._posted.put(flight)
            if self._idle > 0:
                self._idle -= 1
                return flight
            self.waiters += 1
        threading.Thread(target=self._wait, name="biggraph-transfer-waiter", daemon=True).start()
        return flight

    def _wait(self) -> None:
        while True:
            try:
                flight = self._posted.get(timeout=self.IDLE_S)
            except queue.Empty:
                with self._lock:
                    if self._idle > 0:  # (none posted claimed this waiter: it ends; else one is on its way)
                        self._idle -= 1
                        self.waiters -= 1
                        return
                continue
            if flight is None:  # ``close``
                return
            error: Optional[str] = None
            try:
                flight.transfer.wait_unbounded()
            except TransferError as err:
                error = str(err)
            with self._lock:
                self._idle += 1
            self.inbox.put(("ended", flight, error))

    def close(self) -> None:
        """End the idle waiters (those still waiting on a transfer end with it, then wait for work until
        ``IDLE_S``)."""
        with self._lock:
            idle, self._idle = self._idle, 0
            self.waiters -= idle
        for _ in range(idle):
            self._posted.put(None)

    def end(self, flight: Flight) -> None:
        with self._lock:
            if self.by_rank.get(flight.job.rank) is flight:
                del self.by_rank[flight.job.rank]

    def busy(self, rank: int) -> bool:
        with self._lock:
            return rank in self.by_rank

    def overdue(self, now: float) -> list[Flight]:
        """The flights past their deadline not yet reported as such (each is reported once)."""
        late = []
        with self._lock:
            for flight in self.by_rank.values():
                if not flight.overdue and now >= flight.deadline:
                    flight.overdue = True
                    late.append(flight)
        return late

    def next_deadline_in(self, now: float) -> Optional[float]:
        """Seconds to the nearest deadline of a flight not yet overdue (None: nothing to watch)."""
        with self._lock:
            pending = [f.deadline for f in self.by_rank.values() if not f.overdue]
        return max(0.0, min(pending) - now) if pending else None

    def snapshot(self) -> dict[int, str]:
        """Rank -> the kind of its transfer in flight (what a test or a status line may ask)."""
        with self._lock:
            return {rank: f.kind for rank, f in self.by_rank.items()}
