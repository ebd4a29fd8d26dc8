"""The rows a rank keeps pinned under writes behind (``write_behind_buckets``): what a cut unpins, and the word of a
holder whose rows a cut stored. A base of ``PartitionHandoff`` (job/train/distributed/handoff.py), apart so that module
stays within its size; the attributes are the hand-off's, used under its lock.

Why the care: a rank's kept rows since the last cut are the only copy of what was trained since, so they are never
dropped until a cut stores them. A cut of the whole group stores every one (``unpin``). A cut taken in the background
(job/train/distributed/cut_behind.py) stores the rows as they were at this rank's turn, while training goes on:
it unpins only rows kept then and neither kept anew nor taken back to train since (``pinned_marks``,
``unpin_unchanged``); the others hold work after the cut and wait for the next one.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from job.types import PartitionKey


class PinnedRows:
    """Pinning and unpinning of kept rows (see the module docstring)."""

    _lock: threading.Lock
    _kept: OrderedDict[PartitionKey, tuple[Any, str]]
    _pinned: set[PartitionKey]
    _stored: dict[PartitionKey, str]
    _kept_count: dict[PartitionKey, int]
    _retaken: set[PartitionKey]
    _told_stored: set[PartitionKey]
    limit: int

    def _trim(self) -> None:  # (under ``_lock``) the oldest unpinned rows beyond ``limit`` go
        for old in [k for k in self._kept if k not in self._pinned][:max(0, len(self._kept) - self.limit)]:
            del self._kept[old]

    def unpin(self) -> None:
        """A cut stored every row kept so far: they may be dropped again, oldest first, beyond ``limit``."""
        with self._lock:
            self._stored.update((key, digest) for key, (_, digest) in self._kept.items())
            self._pinned.clear()
            self._trim()

    def pinned_marks(self) -> dict[PartitionKey, int]:
        """The pinned rows this rank keeps now, not taken back to train, each with its ``keep`` count: what a cut
        taken in the background unpins once recorded, if still the same rows then (``unpin_unchanged``)."""
        with self._lock:
            return {key: self._kept_count.get(key, 0) for key in self._pinned if key not in self._retaken}

    def unpin_unchanged(self, marks: Mapping[PartitionKey, int]) -> None:
        """A cut taken in the background is recorded: the rows of ``marks`` (``pinned_marks`` at this rank's turn)
        hold nothing trained after it began, so it stored them or newer rows elsewhere; unpin those not kept anew
        or taken back to train since (those hold work after the cut: pinned for the next one)."""
        with self._lock:
            for key, count in marks.items():
                kept = self._kept.get(key)
                if kept is not None and key in self._pinned and key not in self._retaken \
                        and self._kept_count.get(key, 0) == count:
                    self._pinned.discard(key)
                    self._stored[key] = kept[1]
            self._trim()

    def told_stored(self, key: PartitionKey) -> bool:
        """Whether the last holder asked for ``key`` answered that a cut stored those rows (then read the next
        version's file, whatever this rank heard of the written partitions: the cut may be newer than that)."""
        with self._lock:
            if key in self._told_stored:
                self._told_stored.discard(key)
                return True
            return False

    def pinned_bytes(self) -> int:
        """The rows kept that no cut has stored yet (writes behind: never dropped before one does)."""
        with self._lock:
            return sum(self._kept[k][0].weight.nbytes + self._kept[k][0].optim_sum.nbytes for k in self._pinned)
