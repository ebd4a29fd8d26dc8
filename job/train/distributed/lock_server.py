"""The bucket lock server on rank 0: serves ``LockState`` and the shared-parameter vector to every rank of a torchrun
group.

Elsewhere: the messages (protocol.py), the trainer's end (lock_client.py), the scheduling logic (lock_state.py),
the shared vector (shared_vector.py), transfers (transfers.py), the group (group.py), the training loop's scheduler
(job/train/schedule/group.py). Requests and replies travel through the rendezvous TCPStore's queues, the shared
parameters over gloo (transport.py). Every change is persisted before the reply (job/checkpoint/group_progress.py),
except a grant's, whose reply leaves first (commits.py says why that is safe): after a lost pod the new rank 0
replays the records and the pass goes on, redoing only the buckets in flight.
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
from job.train.distributed.commits import Batch, Commit, Committer, ShardSave, VectorWork, replies_early
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
from job.train.distributed.pull_serving import Gatherer, PullServing
from job.train.distributed.replier import Replier
from job.train.distributed.request_gate import RequestGate
from job.train.distributed.request_trace import Traces, mark
from job.train.distributed.server_stats import ServerStats, Stopwatch
from job.train.distributed.shared_rows import RowLayout
from job.train.distributed.shared_vector import SharedVector
from job.train.distributed.transfers import Flights, TransferSlots, Waiting
from job.train.distributed.transport import TensorTransport, TransferError
from job.train.distributed.written_delta import WrittenLog
from job.train.schedule.clock import GroupClocks

logger = logging.getLogger("biggraph")

__all__ = ["LockServer"]

# events the serving thread takes off its inbox at once: judged one by one in their order, then one scan of the
# waiting transfers, one check of the deadlines and one update of the stats for all of them
BATCH_EVENTS = 64


class LockServer(RequestHandlers, PullServing):
    """Serves ``LockState`` and the shared-parameter vector to every rank: requests over the store's queues, the
    shared parameters over ``transport`` (job/train/distributed/transport.py).

    The server receives an announced payload before anything else, whatever it then decides (so that no sender is
    left waiting: a client whose payload nobody takes would time out and lose its pair with rank 0), then answers:
    every request whose rank and channel can be read gets exactly one reply (a ``Refusal`` for an unknown op, a
    malformed field, a change of the wrong shape, a failed progress write, a payload that did not arrive), so a
    client raises at once instead of waiting out its timeout. An answer to a request that carried a change is
    followed by the sum, sent under the request's tag. ``next``, ``written`` and ``release`` persist their changes
    (``progress.append``) before the reply, but for a ``next`` that grants a bucket or says ``wait``: answered once
    its vector work is done, before its record is stored (job/train/distributed/commits.py, ``replies_early``).
    After a failed progress write every request is refused with that error: the group restarts from what is
    stored, never from a state ahead of it. The shared vector's served, stored and pending parts: ``SharedVector``
    (shared_vector.py).

    Never waiting on one peer (job/train/distributed/transfers.py): a request's change is received, and its sum sent,
    by a transfer posted and waited on off the serving thread, which meanwhile answers the other ranks. A request
    is judged once its change has arrived; one whose peer has a transfer in flight, or that finds every transfer
    slot held, waits its turn. A peer whose transfer failed or outlived the transport's timeout is gone: its
    requests are then answered with an error (the round ends through the heartbeat, as for a dead peer).

    What the serving thread does not do (job/train/distributed/commits.py): the vector's arithmetic and the progress
    writes go to the committer's two threads (the vector work, then the records of the requests that arrived together
    written as one object), one sum copied for all of them; their replies and sums leave once that write is stored,
    a grant's once its vector work is done. A request's MAC and decoding are checked on the reader thread
    (request_gate.py), a reply's encoding, MAC and push are done by the replier thread (replier.py, in the order
    decided). The serving thread takes the events queued for it
    together (``BATCH_EVENTS``): each judged in its order, as one at a time, with the per-event upkeep done once.

    Memory: ``SERVER_VECTORS`` (job/train/residency/budget.py): served, stored, persisted, the copy a whole-vector
    progress write takes (commits.py), the transfer slots and at most ``PENDING_VECTORS`` updates of buckets done
    but not yet saved (more wait in local temporary files)."""

    def __init__(self, store: Any, state: LockState, progress: Any, shared: np.ndarray, seed: int,
                 transport: TensorTransport, *, prefix: str = DEFAULT_PREFIX,
                 ending: Callable[[], Optional[str]] = lambda: None,
                 lost: Callable[[], frozenset[int]] = lambda: frozenset(), world_size: Optional[int] = None,
                 layout: Optional[RowLayout] = None, write_behind: int = 0, trace: bool = False,
                 shard_save: Optional[ShardSave] = None) -> None:
        """``progress``: where the changes go (a ``ProgressLog``, or anything with ``append(records)``, whose true
        result asks for a compaction, ``start(state, shared)``);
        ``transport``: this process's end of the shared-parameter transport (the server's rank's); ``ending``: why
        the round ends as the server's process knows it (a SIGTERM, a peer declared dead: ``DistributedContext``),
        None while it stands; ``lost``: the ranks declared dead (fenced), whose requests are refused; ``world_size``:
        the group's, whose ranks alone are served (None: any rank >= 0); ``layout``: which values of ``shared`` are
        relation rows, for sparse changes and pulls (job/train/distributed/shared_rows.py; None: none are);
        ``write_behind``: ``write_behind_buckets`` (0: write groups at every switch; job/train/distributed/cuts.py);
        ``trace``: keep where each request's round trip went (request_trace.py; the bench's breakdown); ``shard_save``:
        ``shared_shards``, the shards save what a record saves (commits.py)."""
        self.requests = request_queue(prefix)
        self.prefix = prefix
        self.store = store.clone()  # the replies (the replier thread's connection)
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
        self._dispatch_due = False  # something may let a waiting request start: scanned after the batch of events
        self._gone: dict[int, str] = {}  # ranks whose transfer failed or timed out, with why
        self._ending = ending
        self._lost = lost
        self._left: Optional[str] = None  # a rank said it leaves (its SIGTERM): the round ends for every rank
        # every rank's bucket times, from the requests served: whom ``settled`` still waits for once the round ends
        self._clocks = GroupClocks(state.world_size)
        self._gave_up: set[int] = set()  # ranks that gave their bucket up and left unwritten: not waited for
        self._stats = ServerStats()  # the serving thread's time (read with ``stats``)
        self.let_in = 0  # requests the reader let in so far
        self._reader_cpu_s = 0.0  # the reader thread's CPU time screening requests (MAC, JSON, replay, fields)
        self.traces = Traces(trace)  # (``traces.take()``: the requests answered so far, with their stamps)
        self._replier = Replier(self.store, prefix, self._stop.is_set, self.traces.finish)
        self._gatherer = Gatherer(self.vector, self._inbox.put)  # pulls' rows read off the serving thread
        # the sums in flight, each one buffer sent to every request of a batch: id -> [sends left, slot, failed]
        self._sums: dict[int, list[Any]] = {}
        self._committer = Committer(self.vector, progress, self._inbox.put, shard_save)  # (shard_save: shared_shards)
        self._unanswered = 0  # requests handed to the committer whose records are not stored yet
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
            marks = self.traces.begin()
            started = time.thread_time()
            kind, incoming, typed = self._gate.screen(raw, self.server_id)  # MAC, JSON, replay, fields: off _serve
            self._reader_cpu_s += time.thread_time() - started  # (this thread's alone: read without a lock)
            if kind == "stop":
                self._inbox.put(("stop",))
                return
            if incoming is not None:
                mark(marks, "inbox")
                self._inbox.put(("request", incoming, typed, marks))
                self.let_in += 1  # (tests: every request queued for the serving thread)

    def _serve(self) -> None:
        while True:
            try:
                first = self._inbox.get(timeout=self._flights.next_deadline_in(time.monotonic()))
            except queue.Empty:  # a transfer's deadline
                first = ("deadline",)
            events = [first]
            while len(events) < BATCH_EVENTS:  # what else is queued already: judged in the same go
                try:
                    events.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            with Stopwatch() as watch:
                ended = self._handle_events(events)
                try:
                    self._expire(time.monotonic())
                    if self._dispatch_due:
                        self._dispatch()
                except Exception:  # noqa: BLE001 - logged, and the server serves on
                    logger.exception("lock server: the transfers' upkeep failed; serving on")
            with self.lock:
                self._stats.busy_s += watch.seconds
                self._stats.cpu_s += watch.cpu_seconds
                self._stats.events += len(events)
                self._stats.batches += 1
                self._stats.largest_batch = max(self._stats.largest_batch, len(events))
            if ended:
                return

    def _handle_events(self, events: list[tuple]) -> bool:
        """Each event in its order, as if it came alone; whether the server's stop (or its queue's end) came (the
        events after it are not served)."""
        for event in events:
            if event[0] in ("stop", "closed"):
                return True
            try:  # no request, however malformed, and no failure of one event stops the serving (issue 44)
                if event[0] == "request":
                    self._on_request(event[1], event[2], event[3] if len(event) > 3 else None)
                elif event[0] == "ended":
                    self._on_ended(event[1], event[2])
                elif event[0] == "ready":
                    self._on_ready(event[1])
                elif event[0] == "committed":
                    self._on_committed(event[1])
                elif event[0] == "gathered":
                    self._on_gathered(*event[1:])
                elif event[0] == "added":
                    for buffer, is_slot in event[1]:
                        self._slots.settle(is_slot, buffer, well=True)
                    self._dispatch_due = True
            except Exception:  # noqa: BLE001 - logged, and the server serves on
                logger.exception("lock server: an event (%s) failed; serving on", event[0])
        return False

    def _on_request(self, incoming: protocol.Incoming, typed: Any, marks: Optional[dict[str, float]] = None) -> None:
        """A request the reader let in (authentic, of the group, not a replay: request_gate.py), ``typed``: decoded;
        ``marks``: its stamps so far, when traced."""
        rank = incoming.envelope.rank
        job = Waiting(incoming, rank, response_queue(self.prefix, rank, incoming.envelope.channel), typed, marks)
        mark(marks, "taken")
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
            self._dispatch_due = True

    def _on_ready(self, batch: Batch) -> None:
        """A batch's vector work is done (its records not yet stored): answer its early commits (``replies_early``,
        job/train/distributed/commits.py), and send each that carried a change the sum (one buffer for the batch)."""
        early = [commit for commit in batch.commits if commit.early]
        with self.lock:
            for commit in early:
                self._push(commit.job, commit.reply)
        if batch.sum is not None:  # sent to every commit of the batch that carried a whole change, early or not
            self._sums[id(batch.sum)] = [sum(commit.wants_sum for commit in batch.commits), batch.sum_slot, False]
            self._send_sum(batch.sum, [commit.job for commit in early if commit.wants_sum])
        self._dispatch_due = True

    def _on_committed(self, batch: Batch) -> None:
        """A batch's records (and the stored vector) are written: answer each request not answered yet, and send
        the sum to each that carried a change."""
        sends = []
        with self.lock:  # answered (handed to the replier, which ``settled`` also waits for) as the count falls
            try:
                for commit in batch.commits:
                    if commit.early and batch.ready:
                        continue  # answered when ready
                    if batch.error is not None:
                        self._refuse(commit.job, LockServerError(
                            f"the progress could not be saved ({batch.error}); the group must restart from what is "
                            "stored"))
                        if commit.buffer is not None:
                            self._slots.settle(commit.slot, commit.buffer, well=True)
                        if commit.wants_sum and batch.sum is not None:  # its share of the sum's sends: none
                            self._settle(batch.sum_slot, batch.sum, well=True)
                        continue
                    self._push(commit.job, commit.reply)
                    if commit.wants_sum:
                        sends.append(commit.job)
            finally:
                self._unanswered -= len(batch.commits)
        if batch.sum is not None and sends:
            self._send_sum(batch.sum, sends)
        self._dispatch_due = True

    def _send_sum(self, buffer: torch.Tensor, jobs: list[Waiting]) -> None:
        """Post the sends of a batch's sum (``buffer``, counted in ``_sums``) to each of ``jobs``."""
        for job in jobs:
            try:
                assert job.incoming.envelope.payload is not None
                transfer = self.transport.send(buffer, job.rank, job.incoming.envelope.payload.tag)
            except TransferError as err:
                self._settle(False, buffer, well=False)
                self._lose(job.rank, str(err))
            else:
                self._flights.start("send", job, buffer, False, transfer)

    def _judge(self, job: Waiting, buffer: Optional[torch.Tensor] = None, slot: bool = False,
               pull_into: Optional[torch.Tensor] = None) -> None:
        """Handle a request (its change arrived into ``buffer``): answered at once if it changed nothing to store,
        else handed to the committer (the reply, and the sum, leave once its records are stored; a grant's once its
        vector work is done: commits.py, ``replies_early``). ``pull_into``: a
        pull's buffer, its values sent after the reply."""
        work = VectorWork(change=buffer.numpy() if buffer is not None else None)
        mark(job.marks, "judged")
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
        mark(job.marks, "submitted")
        if not records and work.change is None and work.unsaved is None:
            self._push(job, reply)
            return
        with self.lock:
            self._unanswered += 1  # (until its records are stored, even when answered before)
        self._committer.submit(Commit(job, reply, records, work, buffer, slot,
                                      wants_sum=buffer is not None and work.rows is None,
                                      early=replies_early(request, reply)))

    def _refuse(self, job: Waiting, err: BaseException) -> None:
        logger.warning("lock server: %s request of rank %s refused: %s: %s", job.incoming.op, job.rank,
                       type(err).__name__, err)
        self._push(job, protocol.Refusal(f"{type(err).__name__}: {err}"))

    def _push(self, job: Waiting, reply: Reply) -> None:
        """Answer ``job``: sealed and pushed by the replier thread, after every reply decided before it; one that
        cannot be pushed (the store going away with the round) is logged, never fatal."""
        mark(job.marks, "answered")
        self._replier.push(job, reply)

    def settled(self, deadline: Optional[float] = None) -> bool:
        """Whether every live rank (not declared dead, not gone) has given back what it held (``LockState.settled``):
        once the round ends, rank 0 serves until then (or its deadline) before it exits. ``deadline`` (monotonic):
        a rank whose bucket in flight cannot end by then (job/train/schedule/clock.py) is not waited for. Never while a
        request decided is not yet stored and answered (the committer's): the state runs ahead of its replies."""
        dead = self._lost() | set(self._gone)
        now = time.monotonic()
        with self.lock:  # (written behind, nothing unsaved can be saved once the round ends: not waited for)
            return self._unanswered == 0 and self._replier.idle() and all(
                self.state.settled(rank, saved=self.cuts is None) or rank in self._gave_up
                or (deadline is not None and self._hopeless(rank, deadline, now))
                for rank in range(self.state.world_size) if rank not in dead)

    def stored(self) -> bool:
        """Whether the records of every request decided so far are stored (a grant is answered before its record
        is: job/train/distributed/commits.py, ``replies_early``)."""
        with self.lock:
            return self._unanswered == 0

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
        stats.update(reader_cpu_s=self._reader_cpu_s, replier_cpu_s=self._replier.cpu_s)
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
        self._replier.stop()  # (every reply decided before the stop leaves)
        self._gatherer.stop()
        self._committer.stop()
        self._flights.close()
