"""The bucket lock server on rank 0: serves ``LockState`` and the shared-parameter vector to every rank of a torchrun
group.

Elsewhere: the messages (protocol.py), the trainer's end (lock_client.py), the scheduling logic (lock_state.py),
the shared vector (shared_vector.py), transfers (transfers.py), the group (group.py), the training loop's scheduler
(job/train/schedule/group.py). Requests and replies travel through the rendezvous TCPStore's queues, the shared
parameters over gloo (transport.py). Every change is persisted before the reply (job/checkpoint/group_progress.py):
after a lost pod the new rank 0 replays the records and the pass goes on, redoing only the buckets in flight.
"""

from __future__ import annotations

import datetime
import logging
import queue
import random
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Optional

import numpy as np
import torch

import storage_adapters as storage
from job.train.distributed import protocol
from job.train.distributed.commits import Batch, Commit, Committer, VectorWork
from job.train.distributed.cuts import Cuts
from job.train.distributed.handlers import RequestHandlers
from job.train.distributed.holders import Holders
from job.train.distributed.lock_state import LockState
from job.train.distributed.protocol import (
    DEFAULT_PREFIX,
    LockServerError,
    ProtocolError,
    Reply,
    request_queue,
    response_queue,
)
from job.train.distributed.pull_serving import PullServing
from job.train.distributed.request_gate import RequestGate
from job.train.distributed.server_stats import ServerStats, Stopwatch
from job.train.distributed.shared_rows import RowLayout
from job.train.distributed.shared_vector import SharedVector
from job.train.distributed.transfers import Flight, Flights, TransferSlots, Waiting
from job.train.distributed.transport import TensorTransport, TransferError
from job.train.distributed.written_delta import WrittenLog
from job.train.schedule.clock import GroupClocks

logger = logging.getLogger("biggraph")

__all__ = ["LockServer"]


class LockServer(RequestHandlers, PullServing):
    """Serves ``LockState`` and the shared-parameter vector to every rank: requests over the store's queues, the
    shared parameters over ``transport`` (job/train/distributed/transport.py).

    The server receives an announced payload before anything else, whatever it then decides (so that no sender is
    left waiting: a client whose payload nobody takes would time out and lose its pair with rank 0), then answers:
    every request whose rank and channel can be read gets exactly one reply (a ``Refusal`` for an unknown op, a
    malformed field, a change of the wrong shape, a failed progress write, a payload that did not arrive), so a
    client raises at once instead of waiting out its timeout. An answer to a request that carried a change is
    followed by the sum, sent under the request's tag. ``next``, ``written`` and ``release`` persist their changes
    (``progress.append``) before the reply. After a failed progress write every request is refused with that error:
    the group restarts from what is stored, never from a state ahead of it. The shared vector's served, stored and
    pending parts: ``SharedVector`` (shared_vector.py).

    Never waiting on one peer (job/train/distributed/transfers.py): a request's change is received, and its sum sent,
    by a transfer posted and waited on off the serving thread, which meanwhile answers the other ranks. A request
    is judged once its change has arrived; one whose peer has a transfer in flight, or that finds every transfer
    slot held, waits its turn. A peer whose transfer failed or outlived the transport's timeout is gone: its
    requests are then answered with an error (the round ends through the heartbeat, as for a dead peer).

    What the serving thread does not do (job/train/distributed/commits.py): the vector's arithmetic and the progress
    writes go to the committer thread, which writes the records of the requests that arrived together as one
    object and copies one sum for all of them; their replies and sums leave once that write is stored.

    Memory: ``SERVER_VECTORS`` (job/train/residency/budget.py): served, stored, the transfer slots and at most
    ``PENDING_VECTORS`` updates of buckets done but not yet saved (more wait in local temporary files)."""

    def __init__(self, store: Any, state: LockState, progress: Any, shared: np.ndarray, seed: int,
                 transport: TensorTransport, *, prefix: str = DEFAULT_PREFIX,
                 ending: Callable[[], Optional[str]] = lambda: None,
                 lost: Callable[[], frozenset[int]] = lambda: frozenset(), world_size: Optional[int] = None,
                 layout: Optional[RowLayout] = None, write_behind: int = 0) -> None:
        """``progress``: where the changes go (a ``ProgressLog``, or anything with ``append(records)``, whose true
        result asks for a compaction, ``start(state, shared)``);
        ``transport``: this process's end of the shared-parameter transport (the server's rank's); ``ending``: why
        the round ends as the server's process knows it (a SIGTERM, a peer declared dead: ``DistributedContext``),
        None while it stands; ``lost``: the ranks declared dead (fenced), whose requests are refused; ``world_size``:
        the group's, whose ranks alone are served (None: any rank >= 0); ``layout``: which values of ``shared`` are
        relation rows, for sparse changes and pulls (job/train/distributed/shared_rows.py; None: none are);
        ``write_behind``: ``write_behind_buckets`` (0: write groups at every switch; job/train/distributed/cuts.py)."""
        self.requests = request_queue(prefix)
        self.prefix = prefix
        self.store = store.clone()  # the replies (the serving thread's connection)
        # the requests: the reader thread's own connection (a store client serves one call at a time, and a long
        # blocking pop, which stop() wakes with a message of its own, would hold up the replies)
        self._incoming = store.clone()
        self._incoming.set_timeout(datetime.timedelta(hours=24))
        self._stopper = store.clone()
        self.transport = transport
        self.state = state
        self.progress = progress
        self.layout = layout if layout is not None else RowLayout.dense(int(shared.size))
        if self.layout.size != shared.size:
            raise ValueError(f"a row layout of {self.layout.size} values for a shared vector of {shared.size}")
        self.vector = SharedVector(shared, layout=self.layout)
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self._failed: Optional[str] = None  # a progress write failed: every request is refused with this
        self.server_id = secrets.token_hex(4)  # the servers of a round's passes share its queue: stop only this one
        self.written_log = WrittenLog(self.server_id)  # the written partitions, each sent to a client once
        self._stop = threading.Event()
        # the serving thread's one input: requests (from the reader thread) and the ends of transfers
        self._inbox: queue.Queue[Any] = queue.Queue()
        self._slots = TransferSlots(self.vector.size)
        self._gate = RequestGate(prefix, world_size)  # what is let in (MAC, rank, no replay)
        # the largest change of the wrong shape still received (to be refused with the pair kept usable)
        self._drain_limit = max(2 * self.vector.size, 2**20)
        self._flights = Flights(self._inbox, transport.timeout_s)
        self._waiting: deque[Waiting] = deque()  # requests with a change whose transfer has not started
        self._gone: dict[int, str] = {}  # ranks whose transfer failed or timed out, with why
        self._ending = ending
        self._lost = lost
        self._left: Optional[str] = None  # a rank said it leaves (its SIGTERM): the round ends for every rank
        # every rank's bucket times, from the requests served: whom ``settled`` still waits for once the round ends
        self._clocks = GroupClocks(state.world_size)
        self._gave_up: set[int] = set()  # ranks that gave their bucket up and left unwritten: not waited for
        self._stats = ServerStats()  # the serving thread's time (read with ``stats``)
        # the sums in flight, each one buffer sent to every request of a batch: id -> [sends left, slot, failed]
        self._sums: dict[int, list[Any]] = {}
        self._committer = Committer(self.vector, progress, self._inbox.put)
        self._unanswered = 0  # requests handed to the committer whose replies have not left yet
        self.holders = Holders(state.bucket_keys, gone=lambda: self._lost() | set(self._gone))  # partition_handoff
        self.cuts, self.holders.strict = (Cuts(write_behind), True) if write_behind else (None, False)
        # with the caller's storage settings: the progress goes to checkpoint storage (an endpoint of its own, say)
        self.thread = threading.Thread(target=storage.carry(self._serve), name="biggraph-lock-server", daemon=True)
        self._reader = threading.Thread(target=self._read, name="biggraph-lock-requests", daemon=True)
        self.thread.start()
        self._reader.start()

    def _read(self) -> None:
        """Requests from the store's queue into the inbox, until this server's stop (nothing past it is taken)."""
        while not self._stop.is_set():
            try:
                raw = self._incoming.queue_pop(self.requests, block=True)
            except Exception:  # the store went away (job ending): nothing left to serve
                if not self._stop.is_set():
                    logger.warning("lock server: request queue closed")
                self._inbox.put(("closed",))
                return
            kind, incoming, typed = self._gate.screen(raw, self.server_id)  # MAC, JSON, replay, fields: off _serve
            if kind == "stop":
                self._inbox.put(("stop",))
                return
            if incoming is not None:
                self._inbox.put(("request", incoming, typed))

    def _serve(self) -> None:
        while True:
            try:
                event = self._inbox.get(timeout=self._flights.next_deadline_in(time.monotonic()))
            except queue.Empty:  # a transfer's deadline
                event = ("deadline",)
            if event[0] in ("stop", "closed"):
                return
            with Stopwatch() as watch:
                try:  # no request, however malformed, and no failure of one event stops the serving (issue 44)
                    if event[0] == "request":
                        self._on_request(event[1], event[2])
                    elif event[0] == "ended":
                        self._on_ended(event[1], event[2])
                    elif event[0] == "committed":
                        self._on_committed(event[1])
                    elif event[0] == "added":
                        for buffer, is_slot in event[1]:
                            self._slots.settle(is_slot, buffer, well=True)
                        self._dispatch()
                    self._expire(time.monotonic())
                except Exception:  # noqa: BLE001 - logged, and the server serves on
                    logger.exception("lock server: an event (%s) failed; serving on", event[0])
            with self.lock:
                self._stats.busy_s += watch.seconds
                self._stats.cpu_s += watch.cpu_seconds
                self._stats.events += 1

    def _on_request(self, incoming: protocol.Incoming, typed: Any) -> None:
        """A request the reader let in (authentic, of the group, not a replay: request_gate.py), ``typed``: decoded."""
        rank = incoming.envelope.rank
        job = Waiting(incoming, rank, response_queue(self.prefix, rank, incoming.envelope.channel), typed)
        try:
            self._admit(job)
        except Exception as err:  # noqa: BLE001 - answered (and logged once) with what failed
            self._refuse(job, err)

    def _admit(self, job: Waiting) -> None:
        rank, incoming = job.rank, job.incoming
        if rank in self._gone:
            self._refuse(job, LockServerError(f"rank {rank} is treated as gone ({self._gone[rank]}); its round is "
                                              "over"))
        elif rank in self._lost():  # fenced: nothing it wrote since may be recorded (its buckets are redone)
            self._refuse(job, LockServerError(f"rank {rank} was declared dead; its round is over"))
        elif incoming.envelope.payload is None and incoming.op != "pull":
            self._judge(job, None)
        else:  # a change to receive, or a pull to send (each needs a buffer, and its peer free of transfers)
            self._waiting.append(job)
            self._dispatch()

    def _dispatch(self) -> None:
        """Start the receive of every waiting request whose peer has no transfer in flight, while slots last."""
        for job in list(self._waiting):
            if job.rank in self._gone:
                self._waiting.remove(job)
                self._refuse(job, LockServerError(f"rank {job.rank} is treated as gone ({self._gone[job.rank]})"))
                continue
            if self._flights.busy(job.rank):
                continue  # its sum not yet reported taken: a correct client asks again only after taking it
            payload = job.incoming.envelope.payload
            if payload is None:  # a pull: its values leave from a buffer of their own once it is judged
                if self._dispatch_pull(job):
                    self._waiting.remove(job)
                continue
            values, tag = payload.values, payload.tag
            if values > self._drain_limit:  # no buffer is sized from what a peer claims: refused unreceived, and its
                # transfer pair is left unusable, so the rank is treated as gone
                self._waiting.remove(job)
                why = f"it announced a change of {values} values (the shared parameters have {self.vector.size})"
                self._lose(job.rank, why)
                self._refuse(job, ProtocolError(why))
                continue
            if values == self.vector.size:
                slot = self._slots.take()
                if slot is None:
                    continue  # every slot held: it waits for one
                buffer, is_slot = slot, True
            elif values < self.vector.size and "rows" in job.incoming.fields:  # a sparse change
                sparse = self._slots.take_sparse(values)
                if sparse is None:
                    continue  # the sparse buffers' bound reached: it waits for one to end
                buffer, is_slot = sparse, False
            else:  # taken only to be refused, so that its sender is not left waiting (at most the vector's size:
                # ``read_incoming`` refuses a larger announcement)
                buffer, is_slot = torch.empty(values, dtype=torch.float32), False
            self._waiting.remove(job)
            try:
                transfer = self.transport.recv_async(buffer, job.rank, tag)
            except Exception as err:  # noqa: BLE001 - a TransferError, or gloo refusing the peer: answered
                self._slots.settle(is_slot, buffer, well=False)
                self._lose(job.rank, str(err))
                self._refuse(job, err)
                continue
            self._flights.start("receive", job, buffer, is_slot, transfer)

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
        self._dispatch()

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

    def _on_committed(self, batch: Batch) -> None:
        """A batch's records (and the stored vector) are written: answer each request, and send the sum to each
        that carried a change (one buffer for all of them)."""
        sends = []
        with self.lock:  # answered below, in this event (a stop is served after it)
            self._unanswered -= len(batch.commits)
        for commit in batch.commits:
            if batch.error is not None:
                self._refuse(commit.job, LockServerError(
                    f"the progress could not be saved ({batch.error}); the group must restart from what is stored"))
                if commit.buffer is not None:
                    self._slots.settle(commit.slot, commit.buffer, well=True)
                continue
            self._push(commit.job, commit.reply)
            if commit.wants_sum:
                sends.append(commit.job)
        if batch.sum is not None and not sends:  # (a failed write: nothing is sent)
            self._slots.settle(batch.sum_slot, batch.sum, well=True)
        elif batch.sum is not None:
            self._sums[id(batch.sum)] = [len(sends), batch.sum_slot, False]
            for job in sends:
                try:
                    assert job.incoming.envelope.payload is not None
                    transfer = self.transport.send(batch.sum, job.rank, job.incoming.envelope.payload.tag)
                except TransferError as err:
                    self._settle(False, batch.sum, well=False)
                    self._lose(job.rank, str(err))
                else:
                    self._flights.start("send", job, batch.sum, False, transfer)
        self._dispatch()

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
            self._dispatch()

    def _lose(self, rank: int, why: str) -> None:
        if rank not in self._gone:
            self._gone[rank] = why
            logger.warning("lock server: the shared parameters did not reach rank %d or come from it (%s); it is "
                           "treated as gone, its requests refused", rank, why)

    def _judge(self, job: Waiting, buffer: Optional[torch.Tensor] = None, slot: bool = False,
               pull_into: Optional[torch.Tensor] = None) -> None:
        """Handle a request (its change arrived into ``buffer``): answered at once if it changed nothing to store,
        else handed to the committer (the reply, and the sum, leave once its records are stored). ``pull_into``: a
        pull's buffer, its values sent after the reply."""
        work = VectorWork(change=buffer.numpy() if buffer is not None else None)
        try:
            with Stopwatch() as watch:
                request = job.request()
                reply, records = self._handle(job.rank, request, work)
                if work.pull is not None and (pull_into is None
                                              or pull_into.numel() != self.layout.count(work.pull.size)):
                    raise ProtocolError(f"a pull of {work.pull.size} rows without its buffer")
        except Exception as err:  # noqa: BLE001 - answered: the client raises with this message
            for held, is_slot in ((buffer, slot), (pull_into, False)):
                if held is not None:
                    self._slots.settle(is_slot, held, well=True)
            self._refuse(job, err)
            return
        with self.lock:
            self._stats.judged(job.incoming.op, watch.seconds)
        if work.pull is not None and pull_into is not None and isinstance(request, protocol.Pull):
            self._send_pull(job, work.pull, pull_into, request.tag)
            return
        if not records and work.change is None and work.unsaved is None:
            self._push(job, reply)
            return
        with self.lock:
            self._unanswered += 1
        self._committer.submit(Commit(job, reply, records, work, buffer, slot,
                                      wants_sum=buffer is not None and work.rows is None))

    def _refuse(self, job: Waiting, err: BaseException) -> None:
        logger.warning("lock server: %s request of rank %s refused: %s: %s", job.incoming.op, job.rank,
                       type(err).__name__, err)
        self._push(job, protocol.Refusal(f"{type(err).__name__}: {err}"))

    def _push(self, job: Waiting, reply: Reply) -> None:
        """Answer ``job``; a reply that cannot be pushed (the store going away with the round) is logged, never
        fatal: the server serves on until it is stopped or its request queue closes."""
        try:
            envelope = job.incoming.envelope
            scope = protocol.reply_scope(self.prefix, envelope.rank, envelope.channel, envelope.seq)
            self.store.queue_push(job.reply_to, protocol.encode_reply(reply, scope=scope))
        except Exception as err:  # noqa: BLE001
            if not self._stop.is_set():
                logger.warning("lock server: could not answer rank %s's %s (%s)", job.rank, job.incoming.op, err)

    def settled(self, deadline: Optional[float] = None) -> bool:
        """Whether every live rank (not declared dead, not gone) has given back what it held (``LockState.settled``):
        once the round ends, rank 0 serves until then (or its deadline) before it exits. ``deadline`` (monotonic):
        a rank whose bucket in flight cannot end by then (job/train/schedule/clock.py) is not waited for. Never while a
        request decided is not yet stored and answered (the committer's): the state runs ahead of its replies."""
        dead = self._lost() | set(self._gone)
        now = time.monotonic()
        with self.lock:  # (written behind, nothing unsaved can be saved once the round ends: not waited for)
            return self._unanswered == 0 and all(
                self.state.settled(rank, saved=self.cuts is None) or rank in self._gave_up
                or (deadline is not None and self._hopeless(rank, deadline, now))
                for rank in range(self.state.world_size) if rank not in dead)

    def _hopeless(self, rank: int, deadline: float, now: float) -> bool:
        """``rank`` still trains a bucket that cannot end by ``deadline``, so waiting for it is waiting in vain."""
        return rank in self.state.in_flight and not self._clocks.ends_by(rank, deadline, now)

    def in_flight(self) -> dict[int, str]:  # rank -> "receive" or "send": the transfers not yet ended
        return self._flights.snapshot()

    def gone(self) -> dict[int, str]:  # the ranks treated as gone (a transfer failed or timed out), with why
        return dict(self._gone)

    def stats(self) -> dict[str, Any]:
        """The serving thread's time so far (``ServerStats``, job/train/distributed/server_stats.py), and the
        committer's (``committer``: its time on the vector and on progress writes, the batches it wrote)."""
        with self.lock:
            stats = self._stats.as_dict()
        committer = self._committer.snapshot()
        stats.update(committer=committer, progress_s=committer["progress_s"], appends=committer["batches"],
                     shared_appends=committer["shared_writes"], copy_s=committer["vector_s"],
                     pending_spilled=self.vector.spilled)
        return stats

    @property
    def slots_allocated(self) -> int:  # transfer vectors alive now (at most ``TRANSFER_SLOTS``)
        return self._slots.allocated

    @property
    def failed(self) -> Optional[str]:
        """Why a progress write failed (then every request is refused: the group restarts from what is stored)."""
        return self._failed or self._committer.failed

    @property
    def shared(self) -> np.ndarray:
        """The shared parameters as served now."""
        return self.vector.served

    def values(self) -> torch.Tensor:
        """The shared parameters as served now (a view: read it once the pass's syncs are over)."""
        return torch.from_numpy(self.vector.served)

    def take_records(self) -> list[dict]:
        with self.lock:
            records, self.state.records = self.state.records, []
            return records

    def stop(self) -> None:
        self._stop.set()
        self._stopper.queue_push(self.requests, protocol.encode_request(
            protocol.Envelope(rank=-1), protocol.Stop(server=self.server_id), scope=self.prefix))
        self.thread.join(timeout=5)
        self._committer.stop()
        self._flights.close()
