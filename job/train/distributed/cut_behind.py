"""A cut taken in the background while the group trains (``write_behind_buckets`` N > 0 and the ``memory_budget``
pinned-limit cut; job/train/distributed/cuts.py has the stop-the-group cut and the whole story).

A consistent snapshot, not a stop. When the cut becomes due (time t0, at some rank's ``next``) its set D is fixed:
the buckets done and unsaved plus those in flight (they finish inside D). Buckets started after t0 are not in D; a
later cut saves them. Each partition D trained (``keys``) is staged by its *stager*: the rank that last started a
bucket training it (``LockState.trainer``), which has its rows after D's buckets, in its store or kept (pinned).

Why the staged rows are D's and no later bucket's: every live rank takes one *turn* at its first ``next`` after t0,
before it starts anything after t0 (the server answers that ``next`` with ``cut``, keeping the rank's reservation):
it stages its keys then, so nothing it trains after t0 reaches them. Another rank cannot train a partition a stager
still has in its store (its lock), and one the stager released kept is pinned there, unchanged until the cut stores
it (``PartitionHandoff``: a rank trains only rows it takes, and retakes its own only through a bucket it starts):
another rank may take a copy of those and train it meanwhile, the stager stages the pinned rows as D left them. So
partitions D did not touch, and pinned ones, stay grantable; only a stager's own next bucket waits for its turn.

The record: once every key of D is staged and every bucket of D is done, ONE ``cut`` record names the staged files
and exactly D's buckets (``LockState.record_cut``): those leave ``unsaved`` and the committer moves exactly their
pending shared updates into the stored vector (``VectorWork.unsaved`` still holds every bucket started after t0).
Then each rank that took its turn *moves* at its next ``next`` (its staged files to their PBG names) and unpins the
rows it kept when it took its turn and has not changed since (the cut stored them, or newer rows elsewhere did); rows
kept after its turn stay pinned for the next cut. A death before the record: the cut never happened (a restart
removes the staged files and redoes every bucket since the last record). After it: the restart's roll-forward moves
what a dead rank did not. The next cut begins only once this one is over (every rank moved).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from job.checkpoint.write_groups import STAGED_PREFIX
from job.train.distributed.lock_state import LockState
from job.train.distributed.protocol import LockServerError
from job.types import Bucket, PartitionKey


@dataclass
class BehindCut:
    """One background cut (see the module docstring). ``buckets``: D; ``stager``: each key of D and the rank staging
    it; ``live``: the ranks at t0, each of which takes one turn and then one move."""

    buckets: frozenset[Bucket]
    stager: dict[PartitionKey, int]
    live: frozenset[int]
    turned: set[int] = field(default_factory=set)
    reports: dict[int, list[Any]] = field(default_factory=dict)
    recorded: bool = False
    unmoved: set[int] = field(default_factory=set)  # ranks that took their turn and have not moved since the record
    pinned_at_turn: dict[int, set[PartitionKey]] = field(default_factory=dict)  # (the server's count of pinned rows)

    @classmethod
    def begin(cls, state: LockState, live: Collection[int]) -> BehindCut:
        """The cut due now: D and who stages what (``LockServerError`` if a key's latest rows are on no live rank:
        then the round must restart from the last cut)."""
        buckets = frozenset(state.unsaved_buckets()) | frozenset(state.in_flight.values())
        stager: dict[PartitionKey, int] = {}
        for bucket in buckets:
            for key in state.bucket_keys[bucket]:
                rank = state.trainer.get(key)
                if rank is None or rank not in live:
                    raise LockServerError(f"{key[0]} partition {key[1]} was trained since the last cut but no live "
                                          f"rank holds its rows (last trained by {rank}); the round must restart "
                                          "from the last cut")
                stager[key] = rank
        return cls(buckets=buckets, stager=stager, live=frozenset(live))

    def keys_of(self, rank: int) -> tuple[PartitionKey, ...]:
        return tuple(sorted(key for key, stager in self.stager.items() if stager == rank))

    def owes(self, rank: int) -> bool:
        """Whether ``rank``'s next ``next`` must be a turn of this cut: its stage (first ``next`` after t0), or its
        move once the cut is recorded."""
        return rank in self.live and (rank not in self.turned or (self.recorded and rank in self.unmoved))

    @property
    def over(self) -> bool:
        return self.recorded and not self.unmoved and self.turned >= self.live

    def report(self, rank: int, staged: Sequence[Any], pinned: Collection[PartitionKey]) -> None:
        """``rank`` took its turn: ``staged`` must name exactly its keys, each a staged file with its size and
        CRC-32; ``pinned``: what the server counts as kept there now (unpinned by its move)."""
        named = sorted((str(s[0]), int(s[1])) for s in staged)
        if named != list(self.keys_of(rank)):
            raise LockServerError(f"rank {rank} staged {named}, not the partitions this cut gave it "
                                  f"({list(self.keys_of(rank))})")
        for entry in staged:
            if len(entry) < 5 or not str(entry[2]).startswith(STAGED_PREFIX) or "/" in str(entry[2]):
                raise LockServerError(f"rank {rank}: {entry!r} is not a staged file with its size and CRC-32")
        self.turned.add(rank)
        self.reports[rank] = list(staged)
        self.pinned_at_turn[rank] = set(pinned)
        if self.recorded:
            self.unmoved.add(rank)

    def ready(self, state: LockState) -> bool:
        """Whether the cut may be recorded: every key staged, every bucket of D done."""
        return (not self.recorded and set(self.stager.values()) <= self.turned
                and all(bucket in state.done for bucket in self.buckets))

    def record(self, state: LockState) -> int:
        """The cut's one record: D's keys made current by the staged files, exactly D's buckets saved; returns the
        number of files."""
        staged = [entry for rank in sorted(self.reports) for entry in self.reports[rank]]
        state.record_cut(sorted(self.stager), staged, buckets=sorted(self.buckets))
        self.recorded = True
        self.unmoved = set(self.turned)
        return len(staged)
