"""Distributed training under torchrun: the bucket lock server on rank 0, and shared-parameter sync.

(Joining the group, the heartbeat and the store barriers are in job/train/distributed/group.py; the scheduler the
training loop sees is ``LockServerScheduler`` in job/train/schedule/group.py.)

The requests and replies travel through the rendezvous TCPStore that ``init_process_group`` already
connected every rank to (``queue_push``/``queue_pop`` give a request queue without any
socket code of ours), so only members of the job's rendezvous can talk to the server. The shared
parameters' payload does not: it goes point-to-point between the trainer and rank 0 over a gloo group
of its own (``TensorTransport``, job/train/distributed/transport.py), tagged with its request.

- ``LockState`` (job/train/distributed/lock_state.py) is the pure scheduling logic: which bucket a trainer gets,
  which partitions are locked, which are written into the next version, and the early reservation
  of a trainer's next bucket with ``prefetch_partitions``.
- ``LockServer`` runs it in a thread on rank 0, answers every request (errors included: ``LockServerError`` on
  the client) and persists each change into checkpoint storage before answering (job/checkpoint/group_progress.py: a
  snapshot per pass plus one small record per change, bound to its run); after a lost pod torchrun restarts
  the group, the new rank 0 replays them and the pass goes on, redoing only the buckets in flight.
- Shared parameters (relation operators, global embeddings, unpartitioned entity tables)
  are kept by the server as one flat vector; trainers push the change they made since
  their last sync and pull the sum at every bucket boundary (staleness: one bucket). A request
  carrying a change says so in its header (``values``: how many, ``tag``: its transfer); the
  change itself and the sum answered travel over the transport, never through the store.
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
from job.train.distributed.server_stats import ServerStats, Stopwatch
from job.train.distributed.transfers import Flight, Flights, TransferSlots, Waiting
from job.train.distributed.transport import TensorTransport, TransferError
from job.train.schedule.clock import BucketClock
from job.types import Bucket

logger = logging.getLogger("biggraph")

__all__ = ["LockServer"]


class _Unanswerable(Exception):
    """The store refused a reply: the job is ending, the server stops."""


class LockServer:
    """Serves ``LockState`` and the shared-parameter vector to every rank: requests over the store's queues, the
    shared parameters over ``transport`` (job/train/distributed/transport.py).

    The protocol: a request is ``{"op", "rank", "channel", ...}``; one that carries a shared-parameter change
    (``next`` finishing a bucket, ``sync``) names it with ``{"values": <how many>, "tag": <its transfer>}``, and the
    client has posted the payload under that tag before pushing the request. The server receives an announced
    payload before anything else, whatever it then decides (so that no sender is left waiting: a client whose
    payload nobody takes would time out and lose its pair with rank 0), then answers: every request whose rank and
    channel can be read gets exactly one reply, ``{"ok": true, ...}`` or ``{"ok": false, "error": "<the server's
    error>"}`` (an unknown op, a malformed field, a change of the wrong shape, a failed progress write, a payload
    that did not arrive), so a client raises at once (``LockServerError``) instead of waiting out its timeout. An
    ``ok`` reply to a request that carried a change is followed by the sum, sent under the request's tag. ``next``,
    ``written`` (a write group's one record) and ``release`` persist their changes (``progress.append``,
    job/checkpoint/group_progress.py) before the reply.

    Shared parameters: a ``next`` carries the trainer's change since its last sync for the bucket it finishes; the
    server adds it to the vector it serves (``shared``) and answers with the sum. What it persists (``stored``)
    holds the change of a bucket only once the bucket is done *and* its partitions are written: until then a
    restart redoes the bucket (``LockState.forget_rank_locks``), so its change waits in ``pending`` and enters
    ``stored`` with the record that saves the bucket. A restart thus resumes with every saved bucket's shared
    update once and without any bucket it redoes. After a failed progress write the server answers every request
    with that error: the group restarts from what is stored, never from a state ahead of it.

    Never waiting on one peer (job/train/distributed/transfers.py): a request's change is received, and its sum sent,
    by a transfer posted and waited on off the serving thread, which meanwhile answers the other ranks. A request
    is judged once its change has arrived; one whose peer has a transfer in flight, or that finds every transfer
    slot held, waits its turn. A peer whose transfer failed or outlived the transport's timeout is gone: its
    requests are then answered with an error (the round ends through the heartbeat, as for a dead peer).

    Memory (``SERVER_VECTORS``): ``shared``, ``stored`` and the ``TRANSFER_SLOTS`` transfer vectors (a sum is sent
    from a copy: the served vector changes with the next request while the peer may not have taken it yet), plus
    one vector per bucket done but not yet saved (``pending``)."""

    def __init__(self, store: Any, state: LockState, progress: Any, shared: np.ndarray, seed: int,
                 transport: TensorTransport, prefix: str = DEFAULT_PREFIX,
                 ending: Callable[[], Optional[str]] = lambda: None,
                 lost: Callable[[], frozenset[int]] = lambda: frozenset()) -> None:
        """``progress``: where the changes go (a ``ProgressLog``, or anything with ``append(records)``, whose true
        result asks for a compaction, ``start(state, shared)``);
        ``transport``: this process's end of the shared-parameter transport (the server's rank's); ``ending``: why
        the round ends as the server's process knows it (a SIGTERM, a peer declared dead: ``DistributedContext``),
        None while it stands; ``lost``: the ranks declared dead (fenced), whose requests are refused."""
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
        self.shared = shared.astype(np.float32, copy=True)
        self.stored = self.shared.copy()  # the updates of the buckets done and saved: what a restart resumes
        self.pending: dict[Bucket, np.ndarray] = {}  # the update of each bucket done but not yet saved
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.failed: Optional[str] = None  # a progress write failed: every request is refused with this
        self.server_id = secrets.token_hex(4)  # the servers of a round's passes share its queue: stop only this one
        self._stop = threading.Event()
        # the serving thread's one input: requests (from the reader thread) and the ends of transfers
        self._inbox: queue.Queue[Any] = queue.Queue()
        self._slots = TransferSlots(self.shared.size)
        # the largest change of the wrong shape still received (to be refused with the pair kept usable)
        self._drain_limit = max(2 * self.shared.size, 2**20)
        self._flights = Flights(self._inbox, transport.timeout_s)
        self._waiting: deque[Waiting] = deque()  # requests with a change whose transfer has not started
        self._gone: dict[int, str] = {}  # ranks whose transfer failed or timed out, with why
        self._ending = ending
        self._lost = lost
        self._left: Optional[str] = None  # a rank said it leaves (its SIGTERM): the round ends for every rank
        # every rank's bucket times, from the requests served: whom ``settled`` still waits for once the round ends
        self._clocks = [BucketClock() for _ in range(state.world_size)]
        self._gave_up: set[int] = set()  # ranks that gave their bucket up and left unwritten: not waited for
        self._stats = ServerStats()  # the serving thread's time (read with ``stats``)
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
        """Requests from the store's queue into the inbox, until this server's stop (a later server of the round
        reads the same queue: nothing past the stop is taken)."""
        while not self._stop.is_set():
            try:
                raw = self._incoming.queue_pop(self.requests, block=True)
            except Exception:  # the store went away (job ending): nothing left to serve
                if not self._stop.is_set():
                    logger.warning("lock server: request queue closed")
                self._inbox.put(("closed",))
                return
            try:
                header: Optional[dict[str, Any]] = protocol.unpack(raw)
            except ProtocolError:  # the serving thread logs it
                header = None
            if header is not None and header.get("op") == "stop":
                if header.get("server") == self.server_id:
                    self._inbox.put(("stop",))
                    return
                continue  # an earlier server's, which ended between two requests and never read it
            self._inbox.put(("request", raw))

    def _serve(self) -> None:
        while True:
            try:
                event = self._inbox.get(timeout=self._flights.next_deadline_in(time.monotonic()))
            except queue.Empty:  # a transfer's deadline
                event = ("deadline",)
            if event[0] in ("stop", "closed"):
                return
            try:
                with Stopwatch() as watch:
                    if event[0] == "request":
                        self._on_request(event[1])
                    elif event[0] == "ended":
                        self._on_ended(event[1], event[2])
                    self._expire(time.monotonic())
            except _Unanswerable:
                return
            with self.lock:
                self._stats.busy_s += watch.seconds
                self._stats.events += 1

    def _on_request(self, raw: bytes) -> None:
        try:
            incoming = protocol.read_incoming(raw)
        except ProtocolError as err:  # nobody to answer: log it and serve on
            logger.error("lock server: unreadable request, no rank to answer (%s)", err)
            return
        rank = incoming.envelope.rank
        job = Waiting(incoming, rank, response_queue(self.prefix, rank, incoming.envelope.channel))
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
                why = f"it announced a change of {values} values (the shared parameters have {self.shared.size})"
                self._lose(job.rank, why)
                self._refuse(job, ProtocolError(why))
                continue
            if values == self.shared.size:
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
            except TransferError as err:
                self._release(is_slot, buffer, well=False)
                self._lose(job.rank, str(err))
                self._refuse(job, err)
                continue
            self._flights.start("receive", job, buffer, is_slot, transfer)

    def _on_ended(self, flight: Flight, error: Optional[str]) -> None:
        """A transfer ended: judge the request whose change arrived and send its sum, or note a failure."""
        self._flights.end(flight)
        job = flight.job
        if error is not None:
            self._release(flight.slot, flight.buffer, well=False)
            if not flight.overdue:  # an overdue one was reported at its deadline
                self._lose(job.rank, error)
                if flight.kind == "receive":
                    self._refuse(job, TransferError(error))
        elif flight.kind == "receive" and not flight.overdue:
            if self._judge(job, flight.buffer.numpy()):
                with Stopwatch() as watch:
                    flight.buffer.copy_(torch.from_numpy(self.shared))
                self._stats.copy_s += watch.seconds
                try:
                    assert job.incoming.envelope.payload is not None
                    transfer = self.transport.send(flight.buffer, job.rank, job.incoming.envelope.payload.tag)
                except TransferError as err:
                    self._release(flight.slot, flight.buffer, well=False)
                    self._lose(job.rank, str(err))
                else:
                    self._flights.start("send", job, flight.buffer, flight.slot, transfer)
            else:
                self._release(flight.slot, flight.buffer, well=True)
        else:  # a sum taken, or a transfer done after its deadline (its peer counted gone already)
            self._release(flight.slot, flight.buffer, well=True)
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

    def _release(self, is_slot: bool, buffer: torch.Tensor, well: bool) -> None:
        if is_slot:
            if well:
                self._slots.give_back(buffer)
            else:
                self._slots.drop()

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
        try:
            self.store.queue_push(job.reply_to, protocol.encode_reply(reply))
        except Exception as err:
            if not self._stop.is_set():
                logger.warning("lock server: could not answer rank %s", job.rank)
            raise _Unanswerable() from err

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
        return rank in self.state.in_flight and not self._clocks[rank].ends_by(deadline, now)

    def in_flight(self) -> dict[int, str]:
        """Rank -> ``"receive"`` or ``"send"``: the shared-parameter transfers not yet ended."""
        return self._flights.snapshot()

    def gone(self) -> dict[int, str]:
        """The ranks treated as gone (a transfer failed or timed out), with why."""
        return dict(self._gone)

    def stats(self) -> dict[str, Any]:
        """The serving thread's time so far (``ServerStats``, job/train/distributed/server_stats.py)."""
        with self.lock:
            return self._stats.as_dict()

    @property
    def slots_allocated(self) -> int:
        """Transfer vectors alive now (at most ``TRANSFER_SLOTS``)."""
        return self._slots.allocated

    def _handle(self, rank: int, request: Request, change: Optional[np.ndarray]) -> Reply:
        """The reply to ``request`` of ``rank`` (one handler per request type); for a request with a change, its sum
        is sent after the reply."""
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
        delta = self._delta(change) if change is not None else None
        if delta is not None:
            self.shared += delta
        if request.record:
            self.state.add_record(request.record)
        was_done = finished is not None and finished in self.state.done
        why = self.round_ending()
        if why is not None:  # the bucket finished, nothing more: the rank gives back and exits
            self.state.stop(rank, finished)
            kind, bucket = "ending", None
        else:
            kind, bucket = self.state.next_bucket(rank, set(request.held), finished, self.rng)
        self._time(rank, finished, bucket)
        stored = False
        if delta is not None and finished is not None and not was_done and finished in self.state.done:
            if finished in self._unsaved():
                self.pending[finished] = delta.copy()
            else:  # no partition of its own to write: saved already
                self.stored += delta
                stored = True
        self._persist(with_shared=stored)
        return Granted(kind=kind, bucket=bucket, dirty=frozenset(self.state.dirty), why=why)

    def _answer_reserve(self, rank: int, request: Reserve, change: Optional[np.ndarray]) -> Reply:
        # not persisted: a reservation is never started work, so a restart has nothing of it to redo
        bucket = self.state.reserve(rank, self.rng, frozenset(request.leaving)) if self.round_ending() is None \
            else None
        return Reserved(bucket=bucket, dirty=frozenset(self.state.dirty))

    def _answer_written(self, rank: int, request: Written, change: Optional[np.ndarray]) -> Reply:
        # a write group (job/checkpoint/write_groups.py): one record makes all its files current and saves its
        # buckets, shared updates included; the locks stay until the rank has published the files
        self.state.record_written(rank, request.keys, request.staged)
        self._persist(with_shared=self._save_pending())
        return Done()

    def _answer_release(self, rank: int, request: Release, change: Optional[np.ndarray]) -> Reply:
        self.state.release(rank, list(request.keys), written=request.written)
        self._persist(with_shared=self._save_pending())
        return Done()

    def _answer_sync(self, rank: int, request: Sync, change: Optional[np.ndarray]) -> Reply:
        # outside a bucket (the pass's start and end): a change here is not tied to any bucket's progress
        if change is None:
            raise ValueError("a sync without a shared-parameter change")
        self.shared += self._delta(change)
        return Done()

    def _answer_status(self, rank: int, request: Status, change: Optional[np.ndarray]) -> Reply:
        return State(state=self.state.to_json())

    def _time(self, rank: int, finished: Optional[Bucket], bucket: Optional[Bucket]) -> None:
        """``rank``'s bucket clock after a ``next``: its bucket finished (or given up), the next one handed out."""
        clock = self._clocks[rank] if 0 <= rank < len(self._clocks) else None
        if clock is None:
            return
        now = time.monotonic()
        if finished is not None and finished in self.state.done:
            clock.finish(now)
        else:
            clock.drop()
        if bucket is not None:
            clock.start(now)

    def _save_pending(self) -> bool:
        """Move the shared updates of the buckets saved now (done, and no partition unwritten) into ``stored``;
        whether there were any."""
        unsaved = self._unsaved()
        saved = [b for b in self.pending if b not in unsaved]
        for b in saved:
            self.stored += self.pending.pop(b)
        return bool(saved)

    def _unsaved(self) -> set[Bucket]:
        return {b for pending in self.state.unsaved.values() for b in pending}

    def _delta(self, delta: np.ndarray) -> np.ndarray:
        if delta.shape != self.shared.shape:
            raise ValueError(f"a shared-parameter change of {delta.size} values, but the shared parameters have "
                             f"{self.shared.size} (trainers built with different models?)")
        return delta

    def _persist(self, with_shared: bool = False) -> None:
        records = self.state.drain_journal()
        try:
            with Stopwatch() as watch:
                due = self.progress.append(records, shared=self.stored) if with_shared else self.progress.append(records)
                if due:  # a snapshot of what the records replay to (the state now, the stored vector): see progress.py
                    self.progress.start(self.state.to_json(), self.stored)
        except Exception as err:
            self.failed = f"{type(err).__name__}: {err}"
            raise
        if records or with_shared:  # (called with self.lock held)
            self._stats.persisted(watch.seconds, with_shared)

    def values(self) -> torch.Tensor:
        """The shared parameters as served now (a view: read it once the pass's syncs are over)."""
        return torch.from_numpy(self.shared)

    def take_records(self) -> list[dict]:
        with self.lock:
            records, self.state.records = self.state.records, []
            return records

    def stop(self) -> None:
        self._stop.set()
        self._stopper.queue_push(self.requests, protocol.encode_request(protocol.Envelope(rank=-1),
                                                                        protocol.Stop(server=self.server_id)))
        self.thread.join(timeout=5)
