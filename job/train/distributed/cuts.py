"""Partitions written behind the training: the lock server's side of a *cut* (``write_behind_buckets``, issue 45;
docs/design/distributed.md, "Partitions written behind").

With ``partition_handoff`` alone every rank still writes a write group at each switch that lets a partition go,
before the release that names it the partition's holder, so an epoch writes about as many partitions as it has
buckets whatever the number of pods. With writes behind, a rank releases a partition to its next holder *unwritten*
(its rows kept in memory, named with their digest: job/train/distributed/holders.py), and storage receives
partitions only at cuts: every ``every`` buckets done by the group, every ``every_s`` seconds (``cadence``), and at
the pass's end (the commit's).

Why per-rank records cannot save anything then: a partition handed on unwritten holds the updates of buckets whose
other partitions may die with their trainer, so a file one rank writes may hold a bucket that a restart redoes
(counted twice). A cut saves the whole group at once instead, in one of two ways.

*In the background* (job/train/distributed/cut_behind.py, ``behind``): the cuts every ``every`` buckets or ``every_s``
seconds and those the pinned limit calls for at two switches from it. A consistent snapshot of the buckets done or in
flight when it became due, taken while the group trains: each rank stages its part at its next ``next`` and trains on
(at 16 pods and N=32 a cut of the whole group cost every pod 70-80 s of waiting per epoch: bench/RESULTS.md).
``background`` False (tests, the redo bench) takes them as below instead.

*Of the whole group*, the group stopped, where that is right: the pass's end (the commit needs every bucket saved
and none in flight), an orderly end of the round (``before_leaving``: it ends anyway), and a rank one switch from its
pinned limit (memory first). One that becomes due during a background cut lets that one end first (a rank owing a
turn hears its steps first; the plan waits for it):

1. *Drain.* Once a cut is due, ``next`` finishes the rank's bucket and answers ``cut`` instead of another (nothing
   is reserved either; a rank's reservation is dropped with its locks that only it needed).
2. *Plan.* When no rank has a bucket in flight, the server assigns each partition trained since the last cut (the
   keys of the done, unsaved buckets) to the rank that has its latest rows: the rank holding its lock (it trained
   it last and still has it in its store), else its hand-off holder. Nothing changes hands during a cut, so the
   plan is the truth until the cut ends.
3. *Stage.* Each live rank writes its keys under staged names and reports them (``cut`` with ``staged``: exactly
   its keys, or refused). Nothing is persisted yet.
4. *Record.* When every live rank has reported, the server persists ONE ``cut`` record naming every staged file:
   it makes them current and saves every done bucket of every rank, and its committer moves every pending
   shared update into the stored vector (``VectorWork.unsaved`` empty). A death before that record: the cut never
   happened (the restart removes the unrecorded staged files, and redoes every bucket done since the last cut:
   the price of a lost pod is the group's work since the last cut).
5. *Move.* Each rank moves its staged files to their PBG names (a restart's roll-forward finishes this for a
   record whose ranks died), reports ``moved``, and once every live rank has, ``go``: training resumes. Reads of a
   partition whose holder dropped its rows therefore find the cut's file under its PBG name.

A round that ends after a loss abandons a cut not yet recorded (``ending``): a loss cannot save what it did not
write. A round that ends *in order* (a rank's SIGTERM: a pod deleted, evicted, scaled down, or the agent re-forming
the group) takes a cut first (``before_leaving``): every live rank, the leaving one included, stages what it holds
as at any cut, and only then hears ``ending``, so the next round redoes nothing. That cut is abandoned, and the
round ends as after a loss (back to the last cut), once a rank is lost or gives a bucket up, or once the drain
window (``window_s``, ``BIGGRAPH_DRAIN_TIMEOUT``) since the server saw the end is over: exactness first. Every
answer to ``cut`` goes through the committer after the requests decided before it, so ``move`` never reaches a
rank before the record is stored.

``pinned_limit``: the partitions a rank may keep pinned between cuts (the rows it released unwritten since the last
one: never dropped before a cut stores them) within its ``memory_budget`` (job/train/residency/budget.py,
``pinned_partitions``); a cut in the background is due once a rank's next two switches could pass it, one of the
whole group once its next switch could. None (no budget): unbounded.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from job.checkpoint.write_groups import STAGED_PREFIX
from job.train.distributed.cut_behind import BehindCut
from job.train.distributed.cut_wire import Cut, CutStep
from job.train.distributed.holders import Holders
from job.train.distributed.lock_state import LockState
from job.train.distributed.protocol import LockServerError, Release
from job.types import Bucket, PartitionKey

ONLY_AT_THE_COMMIT = -1  # ``write_behind_buckets``: no cut but the pass's end


@dataclass
class CutStats:
    """The cuts of a pass as the server saw them (its pass line)."""

    cuts: int = 0
    files: int = 0  # staged files the cuts recorded


@dataclass
class Cuts:
    """The server's record of the cut under way (see the module docstring). ``every``: buckets done by the group
    between cuts (``ONLY_AT_THE_COMMIT``: none but the pass's end)."""

    every: int
    phase: Optional[str] = None  # None (training), "drain", "stage" (plan made), "move" (recorded)
    plan: dict[int, tuple[PartitionKey, ...]] = field(default_factory=dict)
    reports: dict[int, list[Any]] = field(default_factory=dict)
    moved: set[int] = field(default_factory=set)
    # ranks told the last cut is over that have not heard ``go`` yet: a rank polling for it must not be answered
    # with the next cut's steps (the others may already have trained and made the next one due)
    over: set[int] = field(default_factory=set)
    stats: CutStats = field(default_factory=CutStats)
    window_s: float = 25.0  # how long after a round's orderly end its cut may still begin or be recorded
    pinned_limit: Optional[int] = None  # partitions a rank may keep pinned between cuts (None: unbounded)
    switch: Optional[int] = None  # the partitions one switch may pin at most (a bucket's; from the first ``due``)
    # the partitions each rank released unwritten, its rows kept (pinned), since the last cut
    pinned: dict[int, set[PartitionKey]] = field(default_factory=dict)
    closing_since: Optional[float] = None  # when the server first saw the round end in order
    behind: Optional[BehindCut] = None  # the cut taken in the background now, if any (cut_behind.py)
    background: bool = True  # the cuts every N buckets and at the pinned limit are taken in the background
    abandoned: Optional[str] = None  # why the round's end takes no cut (a loss, the window over): as after a loss
    every_s: float = 0.0  # ``write_behind_seconds``: a cut once this long after the last one began (0: none)
    clock: Callable[[], float] = time.monotonic
    since: float = 0.0  # when the last cut began (at first: when this pass's server started), by ``clock``

    def __post_init__(self) -> None:
        if self.every == 0 or self.every < ONLY_AT_THE_COMMIT:
            raise ValueError(f"write_behind_buckets {self.every}: a cut every N > 0 buckets, or -1 (only at the "
                             "commit); 0 is off (no Cuts)")
        self.since = self.clock()

    def cadence(self, every_s: float, clock: Optional[Callable[[], float]] = None) -> None:
        """A cut also once ``every_s`` seconds passed since the last one began (0: by buckets alone), counted from
        now. Why seconds: what a loss costs with writes behind is the group's work since the last cut, and a bound
        on that is a time (N buckets are minutes on one graph and hours on another); an epoch shorter than
        ``every_s`` still writes one checkpoint's bytes."""
        if every_s < 0:
            raise ValueError(f"write_behind_seconds {every_s}: seconds between cuts, >= 0 (0: none)")
        self.every_s = every_s
        if clock is not None:
            self.clock = clock
        self.since = self.clock()

    @property
    def active(self) -> bool:
        return self.phase is not None

    def due(self, state: LockState, rank: int, finished: Optional[Bucket], closing: bool = False,
            live: Collection[int] = ()) -> bool:
        """Whether ``rank``'s ``next`` finishing ``finished`` must be answered ``cut``: it owes a turn to the cut
        taken in the background (``behind``), or a cut of the whole group is under way, or one becomes due: the
        buckets done and unsaved (``finished`` among them) reach ``every``, or ``every_s`` passed since the last cut
        began (either in the background, unless one is under way), or none is left to do and some are unsaved (the
        pass's last cut, which the commit needs; it stops the group), or the round ends in order (``closing``, it
        stops the group) with some unsaved, or a rank's pinned rows could pass ``pinned_limit`` at its next switch (in
        the background at two switches from it; the group stops at one). ``live``: the ranks not lost (those of a cut
        taken in the background)."""
        self.record_ready(state)
        if self.behind is not None and self.behind.owes(rank):
            return True
        if self.active:
            return True
        ends = finished is not None and state.in_flight.get(rank) == finished and finished not in state.done
        unsaved = len(state.unsaved_buckets()) + int(ends)
        if unsaved == 0:
            return False
        left = state.total - len(state.done) - int(ends)
        cadence = (self.every > 0 and unsaved >= self.every) or (
            self.every_s > 0 and self.clock() - self.since >= self.every_s)
        if left == 0 or closing or self._pinned_full(state, switches=1) or (not self.background and cadence):
            self.phase, self.since = "drain", self.clock()
            return True
        if self.behind is None and self.background and (cadence or self._pinned_full(state, switches=2)):
            self.behind, self.since = BehindCut.begin(state, live), self.clock()
            return self.behind.owes(rank)
        return False

    def reserving(self, rank: int) -> bool:
        """Whether ``rank``'s reservation stays through the ``cut`` it is answered now: a turn in a cut taken in the
        background (it trains its reserved bucket next), not a cut of the whole group."""
        return not self.active and self.behind is not None and self.behind.owes(rank)

    def before_leaving(self, now: float, healthy: bool) -> bool:
        """The round ends: whether it may still take a cut first (see the module docstring). ``healthy``: no rank
        lost, gone or given up. Once it may not, it never may again in this round."""
        if self.closing_since is None:
            self.closing_since = now
        if self.abandoned is None and not healthy:
            self.abandoned = "a rank was lost or gave its bucket up"
        elif self.abandoned is None and now > self.closing_since + self.window_s and self.phase != "move":
            self.abandoned = f"the drain window ({self.window_s:.0f} s) is over"
        return self.abandoned is None

    def kept(self, rank: int, keys: Collection[PartitionKey]) -> None:
        """``rank`` released ``keys`` unwritten, their rows kept: pinned there until a cut records them (one taken in
        the background unpins at the rank's move what it kept before its turn and not since: ``_moved``)."""
        self.pinned.setdefault(rank, set()).update(keys)
        if self.behind is not None and rank in self.behind.pinned_at_turn:
            self.behind.pinned_at_turn[rank] -= set(keys)  # kept anew after its turn: pinned for the next cut

    def bound(self, *, window_s: float, pinned_limit: Optional[int]) -> None:
        """The drain window of an orderly end (``window_s``) and the pinned partitions a rank may keep."""
        self.window_s, self.pinned_limit = window_s, pinned_limit

    def _pinned_full(self, state: LockState, switches: int = 1) -> bool:
        """Whether a rank's pinned rows could pass ``pinned_limit`` within its next ``switches`` switches."""
        if self.pinned_limit is None or not self.pinned:
            return False
        if self.switch is None:
            self.switch = max((len(keys) for keys in state.bucket_keys.values()), default=0)
        return any(len(keys) + switches * self.switch > self.pinned_limit for keys in self.pinned.values())

    def answer(self, state: LockState, holders: Holders, rank: int, request: Cut, live: Collection[int]) -> CutStep:
        """The step ``rank`` takes next (``live``: the ranks not lost); may record the cut (``state.record_cut``)."""
        if rank in self.over:
            self.over.discard(rank)
            return CutStep("go")
        if self.behind is not None and self.behind.owes(rank):  # first, even when the group stops meanwhile
            return self._behind_step(state, rank, request)
        if self.phase == "drain":
            if state.in_flight or self.behind is not None:  # (the one in the background ends first)
                return CutStep("wait")
            self.plan = self._plan(state, holders, live)
            self.phase = "stage"
        if self.phase is None:
            return CutStep("go")
        if self.phase == "stage":
            if request.staged is not None:
                self._report(rank, request.staged)
                if all(r in self.reports for r in live):
                    self._record(state)
                    return CutStep("move")
                return CutStep("wait")
            return CutStep("wait") if rank in self.reports else CutStep("stage", keys=self.plan.get(rank, ()))
        # "move": recorded
        if request.moved:
            self.moved.add(rank)
        if all(r in self.moved for r in live):
            self.phase = None
            self.over = set(self.moved) - {rank}
            self.plan, self.reports, self.moved = {}, {}, set()
            return CutStep("go")
        return CutStep("wait") if rank in self.moved else CutStep("move", keys=self.plan.get(rank, ()))

    def record_ready(self, state: LockState) -> None:
        """Record the cut taken in the background once it may be (every key staged, every bucket of it done)."""
        if self.behind is not None and self.behind.ready(state):
            self.stats.files += self.behind.record(state)
            self.stats.cuts += 1

    def _behind_step(self, state: LockState, rank: int, request: Cut) -> CutStep:
        """``rank``'s turn in the cut taken in the background: ``stage`` its keys (``behind``: its reservation
        stays), then ``go`` (train on) or ``move`` if the cut is recorded; after the record, ``move``, then ``go``."""
        cut = self.behind
        assert cut is not None
        if rank not in cut.turned:
            if request.staged is None:
                # ``behind``: its reservation stays (not when the group stops meanwhile: that drops it)
                return CutStep("stage", keys=cut.keys_of(rank), behind=not self.active)
            cut.report(rank, request.staged, self.pinned.get(rank, set()))
            self.record_ready(state)
            return CutStep("move", keys=cut.keys_of(rank), behind=not self.active) if cut.recorded else CutStep("go")
        if not request.moved:  # (``behind``: as at ``stage``; the rank's move may come within a stop of the group)
            return CutStep("move", keys=cut.keys_of(rank), behind=not self.active)
        cut.unmoved.discard(rank)
        self.pinned[rank] = self.pinned.get(rank, set()) - cut.pinned_at_turn.pop(rank, set())
        if cut.over:
            self.behind = None
        return CutStep("go")

    def _plan(self, state: LockState, holders: Holders, live: Collection[int]) -> dict[int, tuple[PartitionKey, ...]]:
        keys = {key for pending in state.unsaved.values() for bucket_keys in pending.values() for key in bucket_keys}
        plan: dict[int, list[PartitionKey]] = {rank: [] for rank in live}
        for key in sorted(keys):
            owner = state.locks.get(key)
            if owner is None:
                owner = holders.holder(key)
            if owner is None or owner not in plan:
                raise LockServerError(f"{key[0]} partition {key[1]} was trained since the last cut but no live rank "
                                      f"holds its rows (owner {owner}); the round must restart from the last cut")
            plan[owner].append(key)
        return {rank: tuple(owned) for rank, owned in plan.items()}

    def _report(self, rank: int, staged: Sequence[Any]) -> None:
        if rank in self.reports:
            raise LockServerError(f"rank {rank} reported its staged files of this cut twice")
        named = sorted((str(s[0]), int(s[1])) for s in staged)
        if named != sorted(self.plan.get(rank, ())):
            raise LockServerError(f"rank {rank} staged {named}, not the partitions this cut gave it "
                                  f"({sorted(self.plan.get(rank, ()))})")
        for entry in staged:
            if len(entry) < 5 or not str(entry[2]).startswith(STAGED_PREFIX) or "/" in str(entry[2]):
                raise LockServerError(f"rank {rank}: {entry!r} is not a staged file with its size and CRC-32")
        self.reports[rank] = list(staged)

    def _record(self, state: LockState) -> None:
        staged = [entry for rank in sorted(self.reports) for entry in self.reports[rank]]
        state.record_cut(sorted({(str(s[0]), int(s[1])) for s in staged}), staged)
        self.pinned.clear()  # every rank unpins what it keeps once it hears ``go``
        self.phase = "move"
        self.stats.cuts += 1
        self.stats.files += len(staged)

    def check_release(self, state: LockState, rank: int, request: Release, ending: bool) -> None:
        """A release under writes behind: never ``written`` for a partition a bucket trains (only a cut writes
        those), and a partition trained since the last cut leaves only with its rows kept (its holder is then the
        only place its latest rows are), unless the round ends (nothing more is granted, nothing saved)."""
        trained = {key for keys in state.bucket_keys.values() for key in keys}
        keys = {(k[0], int(k[1])) for k in request.keys}
        if request.written and keys & trained:
            raise LockServerError(f"rank {rank} released {sorted(keys & trained)} as written: with writes behind "
                                  "partitions are stored only at cuts")
        if ending:
            return
        unsaved = {key for pending in state.unsaved.values() for bucket_keys in pending.values() for key in bucket_keys}
        kept = {(k[0], int(k[1])) for k in request.kept}
        lost = sorted((keys & unsaved) - kept)
        if lost:
            raise LockServerError(f"rank {rank} released {lost} unwritten without keeping their rows: they hold "
                                  "buckets not yet written by a cut")
