"""What each lock request does to the group's state: the lock server's handlers, one per request type
(job/train/distributed/protocol.py), called by the serving thread with the server's lock held.

Kept apart from job/train/distributed/lock_server.py, which receives, orders and answers requests: here is only the
decision (``LockState``, O(P) per request) and what it leaves for the committer (job/train/distributed/commits.py):
the records to store and the ``VectorWork`` on the shared vector, both done before the reply leaves (a grant's
reply leaves once the vector work is done, before its records are stored: job/train/distributed/commits.py).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from typing import Any, Optional

import numpy as np

from job.train.distributed.commits import VectorWork
from job.train.distributed.cut_wire import Cut, CutStep
from job.train.distributed.cuts import Cuts
from job.train.distributed.holders import Holders
from job.train.distributed.lock_state import LockState
from job.train.distributed.protocol import (
    Done,
    Granted,
    LockServerError,
    Next,
    ProtocolError,
    Pull,
    Release,
    Reply,
    Request,
    Reserve,
    Reserved,
    State,
    Status,
    Sync,
    Written,
)
from job.train.distributed.shared_rows import RowLayout
from job.train.distributed.shared_vector import SharedVector
from job.train.distributed.written_delta import WrittenLog
from job.train.schedule.clock import GroupClocks

logger = logging.getLogger("biggraph")


class RequestHandlers:
    """The handlers of ``LockServer`` (a base class of it: the attributes below are the server's)."""

    state: LockState
    vector: SharedVector
    layout: RowLayout  # which values are relation rows (sparse changes and pulls)
    holders: Holders  # partition_handoff: which rank keeps which partition's current rows
    written_log: WrittenLog  # the partitions written this pass, sent to each client once (written_delta.py)
    rng: random.Random
    lock: threading.Lock
    _clocks: GroupClocks
    _gave_up: set[int]
    _left: Optional[str]
    _ending: Callable[[], Optional[str]]
    _lost: Callable[[], frozenset[int]]
    _gone: dict[int, str]
    _cut_abandon_told = False  # (logged once)
    cuts: Optional[Cuts] = None  # write_behind_buckets: partitions stored only at cuts (job/train/distributed/cuts.py)

    @property
    def failed(self) -> Optional[str]:  # (the server's: why a progress write failed)
        raise NotImplementedError

    def _handlers(self) -> dict[type, Callable[[int, Any, VectorWork], Reply]]:
        return {Next: self._answer_next, Reserve: self._answer_reserve, Written: self._answer_written,
                Release: self._answer_release, Sync: self._answer_sync, Status: self._answer_status,
                Pull: self._answer_pull, Cut: self._answer_cut}

    def round_ending(self) -> Optional[str]:
        """Why this round ends (None while it stands): then ``next`` finishes the rank's bucket and answers
        ``ending`` instead of another, and nothing more is reserved."""
        return self._ending() or self._left

    def _handle(self, rank: int, request: Request, work: VectorWork) -> tuple[Reply, list[dict[str, Any]]]:
        """The reply to ``request`` of ``rank``, by its type's handler (a request's sum is sent after it), and the
        records it leaves to store (before the reply is sent, but for a grant's: commits.py, ``replies_early``);
        ``work``: what it does to the shared vector."""
        handler = self._handlers().get(type(request))
        if handler is None:
            raise ProtocolError(f"a {request.op!r} request is not served")
        with self.lock:
            if self.failed is not None:
                raise LockServerError(f"the progress could not be saved earlier ({self.failed}); the group must "
                                      "restart from what is stored")
            rows = request.rows if isinstance(request, Next) else None
            if work.change is not None:
                if not isinstance(request, (Next, Sync)):
                    raise ValueError(f"a {request.op!r} request carries no shared-parameter change")
                if rows is not None:  # a sparse change: exactly the values of the rows it names
                    work.rows = self.layout.check(np.asarray(rows, np.int64), values=work.change.size)
                else:
                    self.vector.check(work.change)
            elif rows is not None:
                raise ValueError("a 'next' naming the rows of a change it does not carry")
            reply = handler(rank, request, work)
            return reply, self.state.drain_journal()

    def _answer_next(self, rank: int, request: Next, work: VectorWork) -> Reply:
        finished = request.finished
        if request.gave_up:
            self._gave_up.add(rank)
        if request.leaving and self._left is None:
            self._left = f"rank {rank} is leaving ({request.leaving})"
            logger.warning("lock server: %s: the round ends, no more buckets are handed out", self._left)
        if request.record:
            self.state.add_record(request.record)
        was_done = finished is not None and finished in self.state.done
        why = self.round_ending()
        if why is not None:  # the bucket finished, nothing more: the rank gives back and exits, after a cut if the
            # round ends in order and some work is unsaved (job/train/distributed/cuts.py, ``before_leaving``)
            cut = self.cuts is not None and self._cut_before_leaving() and self.cuts.due(
                self.state, rank, finished, closing=True, live=self._live())
            self.state.stop(rank, finished, keep_reserved=cut and self.cuts is not None and self.cuts.reserving(rank))
            kind, bucket = ("cut" if cut else "ending"), None
        elif self.cuts is not None and self.cuts.due(self.state, rank, finished, live=self._live()):
            # write what you hold, then wait (a cut of the group); or stage it and train on (one in the background)
            self.state.stop(rank, finished, keep_reserved=self.cuts.reserving(rank))
            kind, bucket = "cut", None
        else:
            kind, bucket = self.state.next_bucket(rank, set(request.held), finished, self.rng)
        self._clocks.after_next(rank, finished is not None and finished in self.state.done, bucket is not None,
                                time.monotonic())
        if work.change is not None and finished is not None and not was_done and finished in self.state.done:
            work.finished, work.saved = finished, finished not in self.state.unsaved.get(rank, {})
        if self.cuts is not None:  # a cut taken in the background may have been recorded here: its updates stored
            work.unsaved = frozenset(self.state.unsaved_buckets())
        return Granted(kind=kind, bucket=bucket, why=why, holders=self.holders.grant(bucket, request.held),
                       **self._written(request.written_known))

    def _answer_reserve(self, rank: int, request: Reserve, work: VectorWork) -> Reply:
        # not persisted: a reservation is never started work, so a restart has nothing of it to redo
        bucket = self.state.reserve(rank, self.rng, frozenset(request.leaving)) \
            if self.round_ending() is None and not (self.cuts is not None and self.cuts.active) else None
        return Reserved(bucket=bucket, holders=self.holders.grant(bucket, request.leaving),
                        **self._written(request.written_known))

    def _written(self, known: Optional[tuple[str, int]]) -> dict[str, Any]:
        """A reply's written partitions: those the request's client lacks, or all of them to a client that did not
        say what it holds (job/train/distributed/written_delta.py)."""
        if known is None:
            return {"dirty": frozenset(self.state.dirty)}
        self.written_log.catch_up(self.state.dirty)
        return {"written": self.written_log.since(known)}

    def _answer_written(self, rank: int, request: Written, work: VectorWork) -> Reply:
        # a write group (job/checkpoint/write_groups.py): one record makes all its files current and saves its
        # buckets, shared updates included; the locks stay until the rank has published the files
        if self.cuts is not None:
            raise LockServerError(f"rank {rank} sent a write group: with writes behind only a cut of the whole group "
                                  "saves buckets (job/train/distributed/cuts.py)")
        self.state.record_written(rank, request.keys, request.staged)
        self.holders.written(request.keys)
        work.unsaved = frozenset(self.state.unsaved_buckets())
        return Done()

    def _answer_release(self, rank: int, request: Release, work: VectorWork) -> Reply:
        if self.cuts is not None:
            self.cuts.check_release(self.state, rank, request, ending=self.round_ending() is not None)
        if self.cuts is not None and request.kept:
            self.cuts.kept(rank, [(k[0], int(k[1])) for k in request.kept])
        self.state.release(rank, list(request.keys), written=request.written)
        self.holders.released(rank, request.keys, request.kept, written=request.written)
        work.unsaved = frozenset(self.state.unsaved_buckets())
        return Done()

    def _answer_sync(self, rank: int, request: Sync, work: VectorWork) -> Reply:
        # outside a bucket (the pass's start and end): a change here is not tied to any bucket's progress
        if work.change is None:
            raise ValueError("a sync without a shared-parameter change")
        return Done()

    def _answer_pull(self, rank: int, request: Pull, work: VectorWork) -> Reply:
        # the values leave after the reply (``LockServer._judge``), read from the served vector then
        work.pull = self.layout.check(np.asarray(request.rows, np.int64))
        return Done()

    def _answer_cut(self, rank: int, request: Cut, work: VectorWork) -> Reply:
        if self.cuts is None:
            raise LockServerError("a 'cut' request, but this group writes partitions at every switch")
        why = self.round_ending()
        if why is not None and not self._cut_before_leaving():  # a cut not recorded never happened; one recorded
            return CutStep("ending", why=why)  # is finished by the restart
        step = self.cuts.answer(self.state, self.holders, rank, request, self._live())
        # through the committer, after every request decided before it: ``move`` never outruns the cut's record
        work.unsaved = frozenset(self.state.unsaved_buckets())
        return step

    def _live(self) -> list[int]:
        """The ranks not lost (declared dead, or gone: a failed transfer)."""
        dead = self._lost() | set(self._gone)
        return [r for r in range(self.state.world_size) if r not in dead]

    def _cut_before_leaving(self) -> bool:
        """The round ends: whether a cut may still save the group's work first (written behind, an orderly end: no
        rank lost, gone or given up, and within the drain window; job/train/distributed/cuts.py)."""
        if self.cuts is None:
            return False
        healthy = not (self._lost() or self._gone or self._gave_up)
        first = self.cuts.closing_since is None
        ok = self.cuts.before_leaving(time.monotonic(), healthy)
        if ok and first:
            logger.warning("lock server: the round ends in order (%s): the group takes a cut first if any bucket is "
                           "unsaved, so that the next round redoes nothing done", self.round_ending())
        if not ok and not self._cut_abandon_told:
            self._cut_abandon_told = True
            logger.warning("lock server: the round ends and takes no cut (%s): the next round redoes the buckets "
                           "since the last cut", self.cuts.abandoned)
        return ok

    def _answer_status(self, rank: int, request: Status, work: VectorWork) -> Reply:
        return State(state=self.state.to_json())

