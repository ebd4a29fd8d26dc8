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
from job.train.distributed.holders import Holders
from job.train.distributed.lock_state import LockState
from job.train.distributed.protocol import (
    DEFAULT_PREFIX,
    Done,
    Granted,
    LockServerError,
    Next,
    ProtocolError,
    Release,
    Reply,
    Request,
    Reserve,
    Reserved,
    State,
    Status,
    Sync,
    Written,
    request_queue,
    response_queue,
)
from job.train.distributed.request_gate import RequestGate
from job.train.distributed.server_stats import ServerStats, Stopwatch
from job.train.distributed.shared_vector import SharedVector
from job.train.distributed.transfers import Flight, Flights, TransferSlots, Waiting
from job.train.distributed.transport import TensorTransport, TransferError
from job.train.schedule.clock import GroupClocks

logger = logging.getLogger("biggraph")

__all__ = ["LockServer"]


class LockServer:
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

    Memory: ``SERVER_VECTORS`` (job/train/residency/budget.py), plus one vector per bucket done but not yet saved."""

    def __init__(self, store: Any, state: LockState, progress: Any, shared: np.ndarray, seed: int,
                 transport: TensorTransport, *, prefix: str = DEFAULT_PREFIX,
                 ending: Callable[[], Optional[str]] = lambda: None,
                 lost: Callable[[], frozenset[int]] = lambda: frozenset(), world_size: Optional[int] = None) -> None:
        """``progress``: where the changes go (a ``ProgressLog``, or anything with ``append(records)``, whose true
        result asks for a compaction, ``start(state, shared)``);
        ``transport``: this process's end of the shared-parameter transport (the server's rank's); ``ending``: why
        the round ends as the server's process knows it (a SIGTERM, a peer declared dead: ``DistributedContext``),
        None while it stands; ``lost``: the ranks declared dead (fenced), whose requests are refused; ``world_size``:
        the group's, whose ranks alone are served (None: any rank >= 0)."""
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
        self.vector = SharedVector(shared)
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.failed: Optional[str] = None  # a progress write failed: every request is refused with this
        self.server_id = secrets.token_hex(4)  # the servers of a round's passes share its queue: stop only this one
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
        self.holders = Holders(state.bucket_keys, gone=lambda: self._lost() | set(self._gone))  # partition_handoff
        # one handler per request type (job/train/distributed/protocol.py), called with ``lock`` held
        self._handlers: dict[type, Callable[[int, Any, Optional[np.ndarray]], Reply]] = {
            Next: self._answer_next, Reserve: self._answer_reserve, Written: self._answer_written,
            Release: self._answer_release, Sync: self._answer_sync, Status: self._answer_status}
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
            stop = self._gate.is_stop(raw, self.server_id)
            if stop:
                self._inbox.put(("stop",))
                return
            if stop is None:  # (False: an earlier server's stop, which ended between two requests and never read it)
                self._inbox.put(("request", raw))

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
                        self._on_request(event[1])
                    elif event[0] == "ended":
                        self._on_ended(event[1], event[2])
                    self._expire(time.monotonic())
                except Exception:  # noqa: BLE001 - logged, and the server serves on
                    logger.exception("lock server: an event (%s) failed; serving on", event[0])
            with self.lock:
                self._stats.busy_s += watch.seconds
                self._stats.events += 1

    def _on_request(self, raw: bytes) -> None:
        incoming = self._gate.admit(raw)  # authentic, of the group, not a replay (request_gate.py); else dropped
        if incoming is None:
            return
        rank = incoming.envelope.rank
        job = Waiting(incoming, rank, response_queue(self.prefix, rank, incoming.envelope.channel))
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
        elif incoming.envelope.payload is None:
            self._judge(job, None)
        else:
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
            assert payload is not None  # only a request with a payload waits
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
            self._slots.settle(flight.slot, flight.buffer, well=False)
            if not flight.overdue:  # an overdue one was reported at its deadline
                self._lose(job.rank, error)
                if flight.kind == "receive":
                    self._refuse(job, TransferError(error))
        elif flight.kind == "receive" and not flight.overdue:
            if self._judge(job, flight.buffer.numpy()):
                with Stopwatch() as watch:
                    flight.buffer.copy_(torch.from_numpy(self.vector.served))
                self._stats.copy_s += watch.seconds
                try:
                    assert job.incoming.envelope.payload is not None
                    transfer = self.transport.send(flight.buffer, job.rank, job.incoming.envelope.payload.tag)
                except TransferError as err:
                    self._slots.settle(flight.slot, flight.buffer, well=False)
                    self._lose(job.rank, str(err))
                else:
                    self._flights.start("send", job, flight.buffer, flight.slot, transfer)
            else:
                self._slots.settle(flight.slot, flight.buffer, well=True)
        else:  # a sum taken, or a transfer done after its deadline (its peer counted gone already)
            self._slots.settle(flight.slot, flight.buffer, well=True)
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

    def _judge(self, job: Waiting, change: Optional[np.ndarray]) -> bool:
        """Handle and answer a request (its change arrived); whether its sum is to be sent."""
        try:
            with Stopwatch() as watch:
                request = protocol.decode_request(job.incoming)
                reply = self._handle(job.rank, request, change)
        except Exception as err:  # noqa: BLE001 - answered: the client raises with this message
            self._refuse(job, err)
            return False
        with self.lock:
            self._stats.judged(job.incoming.op, watch.seconds)
        self._push(job, reply)
        return change is not None

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

    def round_ending(self) -> Optional[str]:
        """Why this round ends (None while it stands): then ``next`` finishes the rank's bucket and answers
        ``ending`` instead of another, and nothing more is reserved."""
        return self._ending() or self._left

    def settled(self, deadline: Optional[float] = None) -> bool:
        """Whether every live rank (not declared dead, not gone) has given back what it held (``LockState.settled``):
        once the round ends, rank 0 serves until then (or its deadline) before it exits. ``deadline`` (monotonic):
        a rank whose bucket in flight cannot end by then (job/train/schedule/clock.py) is not waited for."""
        dead = self._lost() | set(self._gone)
        now = time.monotonic()
        with self.lock:
            return all(self.state.settled(rank) or rank in self._gave_up
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
        """The serving thread's time so far (``ServerStats``, job/train/distributed/server_stats.py)."""
        with self.lock:
            return self._stats.as_dict()

    @property
    def slots_allocated(self) -> int:  # transfer vectors alive now (at most ``TRANSFER_SLOTS``)
        return self._slots.allocated

    def _handle(self, rank: int, request: Request, change: Optional[np.ndarray]) -> Reply:
        """The reply to ``request`` of ``rank``, by its type's handler (a request's sum is sent after it)."""
        handler = self._handlers.get(type(request))
        if handler is None:
            raise ProtocolError(f"a {request.op!r} request is not served")
        with self.lock:
            if self.failed is not None:
                raise LockServerError(f"the progress could not be saved earlier ({self.failed}); the group must "
                                      "restart from what is stored")
            if change is not None and not isinstance(request, (Next, Sync)):
                raise ValueError(f"a {request.op!r} request carries no shared-parameter change")
            return handler(rank, request, change)

    def _answer_next(self, rank: int, request: Next, change: Optional[np.ndarray]) -> Reply:
        finished = request.finished
        if request.gave_up:
            self._gave_up.add(rank)
        if request.leaving and self._left is None:
            self._left = f"rank {rank} is leaving ({request.leaving})"
            logger.warning("lock server: %s: the round ends, no more buckets are handed out", self._left)
        if change is not None:
            self.vector.add(change)
        if request.record:
            self.state.add_record(request.record)
        was_done = finished is not None and finished in self.state.done
        why = self.round_ending()
        if why is not None:  # the bucket finished, nothing more: the rank gives back and exits
            self.state.stop(rank, finished)
            kind, bucket = "ending", None
        else:
            kind, bucket = self.state.next_bucket(rank, set(request.held), finished, self.rng)
        self._clocks.after_next(rank, finished is not None and finished in self.state.done, bucket is not None,
                                time.monotonic())
        stored = False
        if change is not None and finished is not None and not was_done and finished in self.state.done:
            stored = self.vector.finish(finished, change, saved=finished not in self.state.unsaved_buckets())
        self._persist(with_shared=stored)
        return Granted(kind=kind, bucket=bucket, dirty=frozenset(self.state.dirty), why=why,
                       holders=self.holders.grant(bucket, request.held))

    def _answer_reserve(self, rank: int, request: Reserve, change: Optional[np.ndarray]) -> Reply:
        # not persisted: a reservation is never started work, so a restart has nothing of it to redo
        bucket = self.state.reserve(rank, self.rng, frozenset(request.leaving)) if self.round_ending() is None \
            else None
        return Reserved(bucket=bucket, dirty=frozenset(self.state.dirty), holders=self.holders.grant(bucket, request.leaving))

    def _answer_written(self, rank: int, request: Written, change: Optional[np.ndarray]) -> Reply:
        # a write group (job/checkpoint/write_groups.py): one record makes all its files current and saves its
        # buckets, shared updates included; the locks stay until the rank has published the files
        self.state.record_written(rank, request.keys, request.staged)
        self.holders.written(request.keys)
        self._persist(with_shared=self.vector.save(self.state.unsaved_buckets()))
        return Done()

    def _answer_release(self, rank: int, request: Release, change: Optional[np.ndarray]) -> Reply:
        self.state.release(rank, list(request.keys), written=request.written)
        self.holders.released(rank, request.keys, request.kept, written=request.written)
        self._persist(with_shared=self.vector.save(self.state.unsaved_buckets()))
        return Done()

    def _answer_sync(self, rank: int, request: Sync, change: Optional[np.ndarray]) -> Reply:
        # outside a bucket (the pass's start and end): a change here is not tied to any bucket's progress
        if change is None:
            raise ValueError("a sync without a shared-parameter change")
        self.vector.add(change)
        return Done()

    def _answer_status(self, rank: int, request: Status, change: Optional[np.ndarray]) -> Reply:
        return State(state=self.state.to_json())

    def _persist(self, with_shared: bool = False) -> None:
        records = self.state.drain_journal()
        try:
            with Stopwatch() as watch:
                due = self.progress.append(records, shared=self.vector.stored) if with_shared else self.progress.append(records)
                if due:  # a snapshot of what the records replay to (the state now, the stored vector): see progress.py
                    self.progress.start(self.state.to_json(), self.vector.stored)
        except Exception as err:
            self.failed = f"{type(err).__name__}: {err}"
            raise
        if records or with_shared:  # (called with self.lock held)
            self._stats.persisted(watch.seconds, with_shared)

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
