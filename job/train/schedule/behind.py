"""A trainer's side of partitions written behind the training (``write_behind_buckets``; the server's side and why
it is exact: job/train/distributed/cuts.py).

At a bucket switch the partitions leaving are released *unwritten*: their rows are kept in this rank's memory
(job/train/distributed/handoff.py, pinned until a cut stores them) and named with their digest, so the next holder
takes them from here. When the server answers ``next`` with ``cut``, the rank takes its turn: it drops what it read
ahead (its reservation is gone, and a copy read for it may be stale once others train again), stages the
partitions the server gives it (from its store when it holds them, else from the rows it keeps), reports them,
waits for the cut's record, moves them to their PBG names, reports that, and waits for every other rank before
training on.

A cut also comes before an orderly end of the round (this rank's SIGTERM, or another's: job/train/distributed/cuts.py,
``before_leaving``). A rank that received the SIGTERM has its drain deadline (the agent's SIGKILL follows): once
that passes before the cut is recorded, it gives up its part (``next`` with ``gave_up``, so the server abandons the
cut and every rank hears ``ending`` at once) and the round ends as after a loss, back to the last cut.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

from job.checkpoint.write_groups import WriteGroup
from job.formats.checkpoint import CheckpointStorage
from job.model.scoring import Table
from job.train.distributed.cut_wire import CutStep
from job.train.distributed.handoff import PartitionHandoff
from job.train.distributed.lock_client import LockClient
from job.train.residency.partitions import PartitionStore
from job.types import PartitionKey

logger = logging.getLogger("biggraph")

POLL_S = 0.01  # the first wait between two asks of a cut's step (doubling to ``POLL_MAX_S``)
POLL_MAX_S = 0.2
LATE = "this rank's drain deadline passed before the cut was recorded"


@dataclass
class CutCounts:
    """This rank's part of the pass's cuts (its pass record)."""

    cuts: int = 0
    background: int = 0  # of them taken in the background (job/train/distributed/cut_behind.py): it trained on
    staged: int = 0  # partitions it staged
    seconds: float = 0.0  # its time in cuts, waits for the other ranks included
    pinned_peak_bytes: int = 0  # the most rows it kept at once that no cut had stored yet (memory_budget bounds it)

    def as_record(self) -> dict[str, float]:
        return {"cuts": self.cuts, "cuts_in_background": self.background, "cut_partitions_staged": self.staged,
                "cut_seconds": round(self.seconds, 3), "pinned_peak_bytes": self.pinned_peak_bytes}


class BehindWrites:
    """Releases without writes, and this rank's turns in cuts (see the module docstring)."""

    def __init__(self, client: LockClient, store: PartitionStore, checkpoint: CheckpointStorage,
                 handoff: PartitionHandoff) -> None:
        self.client = client
        self.store = store
        self.checkpoint = checkpoint
        self.handoff = handoff
        handoff.strict = True  # a failed hand-off ends the round: the file is older than the rows it lost
        self.counts = CutCounts()
        self._deadline: Callable[[], Optional[float]] = lambda: None  # (the cut's: ``cut``)
        self.kept_reservation = False  # (the last ``cut``'s: whether the rank's reservation is still its next)
        # a cut taken in the background that this rank staged for before it was recorded: its group, and the marks
        # of the rows it kept then (what its move unpins)
        self._unmoved: Optional[tuple[WriteGroup, Optional[dict[PartitionKey, int]]]] = None

    def release(self, keep: set[PartitionKey]) -> list[PartitionKey]:
        """Let the resident partitions not in ``keep`` go unwritten, their rows kept for the next holder; returns
        them."""
        leaving = sorted(self.store.resident_partitioned() - keep)
        if not leaving:
            return []
        kept = []
        for key in leaving:
            table = self.store.loaded.pop(key)
            if table.optim_sum is None:
                raise ValueError(f"{key[0]} partition {key[1]} has no optimizer state to hand on")
            kept.append((key[0], key[1], self.handoff.keep(key, table.weight, table.optim_sum,
                                                           self.store.steps.get(key, 0))))
        self.client.release(leaving, written=False, kept=kept)
        self.counts.pinned_peak_bytes = max(self.counts.pinned_peak_bytes, self.handoff.pinned_bytes())
        return leaving

    def give_up(self) -> None:
        """The round ends: hand every lock back unwritten (nothing unsaved can be saved now; rank 0 waits for the
        locks, not for writes), so that rank 0 knows this rank is done before it stops serving."""
        held = sorted(self.store.resident_partitioned())
        try:
            if held:
                self.client.release(held, written=False)
        except Exception as err:  # noqa: BLE001 - rank 0 gone already: the next round redoes everything unsaved
            logger.warning("rank %d: could not hand its locks back at the round's end (%s)", self.client.rank, err)

    def cut(self, deadline: Callable[[], Optional[float]] = lambda: None) -> Optional[str]:
        """This rank's turn in the cut the server announced; None once it is over (or this rank's part of one taken
        in the background is: job/train/distributed/cut_behind.py), else why the round ends (the cut abandoned, or
        recorded and finished by the restart's roll-forward). ``deadline``: this rank's drain deadline (monotonic;
        None while it has none): past it, a cut not yet recorded is given up. ``kept_reservation`` says afterwards
        whether the rank's reserved bucket (and what it read ahead for it) is still its next."""
        started = time.perf_counter()
        self._deadline = deadline
        self.kept_reservation = False
        try:
            step = self._ask()
            if step.step == "move" and self._unmoved is not None:  # a cut taken in the background, recorded since
                self.kept_reservation = step.behind  # (not when the group stops meanwhile: that dropped it)
                if not step.behind:
                    self.store.discard_prefetched()
                return self._move(step, *self._unmoved)
            if step.step != "stage":
                return self._unexpected(step, "stage")
            self.kept_reservation = step.behind
            self.counts.background += int(step.behind)
            if not step.behind:
                self.store.discard_prefetched()  # the cut of the whole group dropped the reservation
            # what this rank keeps now holds nothing trained after the cut began: unpinned once it is recorded
            marks = self.handoff.pinned_marks()
            kept_now = marks if step.behind else None
            group = self._stage(step.keys)
            if self._late():
                return self._give_up_cut()
            step = self._ask(staged=group.staged(self.checkpoint))
            self.counts.staged += len(group.keys)
            if step.step == "go":  # a turn in a cut taken in the background, not recorded yet (the group may have
                # stopped meanwhile, so that the stage did not say `behind`): move at a later turn, unpinning then
                # what is unchanged since this one
                self._unmoved = (group, marks)
                return None
            if step.step != "move":
                return self._unexpected(step, "move")
            return self._move(step, group, kept_now)
        finally:
            self.counts.seconds += time.perf_counter() - started

    def _stage(self, keys: tuple[PartitionKey, ...]) -> WriteGroup:
        """Write ``keys`` under staged names, from this rank's store when it holds them, else from the rows it keeps;
        stored before the report (the record makes them current)."""
        tables: dict[PartitionKey, Any] = {}
        for key in keys:
            table = self.store.loaded.get(key)
            if table is None:
                rows = self.handoff.kept_rows(key)
                if rows is None:
                    raise RuntimeError(f"the cut gave this rank {key[0]} partition {key[1]}, whose rows it no "
                                       "longer keeps")
                table = Table(weight=rows.weight, optim_sum=rows.optim_sum)
                self.store.steps[key] = rows.step
            tables[key] = table
        group = WriteGroup.of(self.store.next_version, [], tables)
        self.store.stage(group)
        self.checkpoint.flush()
        return group

    def _move(self, step: CutStep, group: WriteGroup, kept_now: Optional[dict[PartitionKey, int]]) -> Optional[str]:
        """The cut is recorded: move ``group`` to its PBG names, report it, and unpin what the cut stored (all that is
        kept after a cut of the whole group; ``kept_now``, the rows kept at this rank's turn and unchanged since,
        after one taken in the background)."""
        if step.keys and sorted(step.keys) != sorted(group.keys):
            raise RuntimeError(f"the lock server named {sorted(step.keys)} to move, but this rank staged "
                               f"{sorted(group.keys)}")
        self.store.publish(group)
        self._unmoved = None
        step = self._ask(moved=True)
        if step.step != "go":
            return self._unexpected(step, "go")
        if kept_now is None:
            self.handoff.unpin()
        else:
            self.handoff.unpin_unchanged(kept_now)
        self.counts.cuts += 1
        return None

    def _late(self) -> bool:
        deadline = self._deadline()
        return deadline is not None and time.monotonic() > deadline

    def _give_up_cut(self) -> str:
        """Past this rank's drain deadline: tell the server (the cut is abandoned, every rank hears ``ending``)."""
        logger.warning("rank %d: %s: giving the cut up (the next round redoes the buckets since the last cut)",
                       self.client.rank, LATE)
        try:
            self.client.finish_and_next(set(), None, None, None, leaving=LATE, gave_up=True)
        except Exception as err:  # noqa: BLE001 - rank 0 gone already: its round ended anyway
            logger.warning("rank %d: could not tell the server it gave the cut up (%s)", self.client.rank, err)
        return LATE

    def _ask(self, staged: Optional[list[list[Any]]] = None, moved: bool = False) -> CutStep:
        step = self.client.cut(staged=staged, moved=moved)
        wait = POLL_S
        while step.step == "wait":
            if not moved and self._late():  # (a recorded cut is finished: its moves are renames)
                return CutStep("ending", why=self._give_up_cut())
            time.sleep(wait)
            wait = min(2 * wait, POLL_MAX_S)
            step = self.client.cut()
        return step

    @staticmethod
    def _unexpected(step: CutStep, wanted: str) -> str:
        if step.step == "ending":
            return step.why or "the round ends"
        raise RuntimeError(f"the lock server answered {step.step!r} in a cut where {wanted!r} was due")
