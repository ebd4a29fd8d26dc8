"""Whether a bucket in flight can still end before a round's drain deadline: finish it, or give it up now.

When a round of the group ends (a peer lost, the torchrun agent's SIGTERM), each live rank finishes its bucket and
gives back what it holds, and rank 0 serves until they have or until the drain deadline (``drain_timeout_s``,
job/train/distributed/group.py; under the agent's 30 s between its SIGTERM and its SIGKILL). That pays when a bucket takes a
few seconds. A bucket that takes minutes (a big graph's) cannot end in time: finishing it anyway held every rank
of the group until the deadline (rank 0 waiting for it), and then until the agent's SIGKILL (a rank training on
past its SIGTERM), for a bucket redone all the same. So each rank times its own buckets, and a bucket whose
expected end lies past the deadline is given up at once (``LockServerScheduler.stop_check``: its tables hold part
of its update and are not written, its locks go back unwritten); rank 0 times every rank's buckets from the
requests it serves, and does not wait for a rank whose bucket cannot end in time (``LockServer.settled``).

The expectation is the median of the rank's last ``WINDOW`` buckets, hand-out to finish; with none timed yet (the
round's first bucket) a bucket is tried until the deadline itself.
"""

from __future__ import annotations

import statistics
from collections import deque
from typing import Optional

WINDOW = 8  # buckets timed (their median is the expectation)


class BucketClock:
    """One rank's bucket times: ``start`` when a bucket is handed out, ``finish`` when it is done, ``drop`` when
    it ends otherwise (a redone bucket's time says nothing of the next one's)."""

    def __init__(self) -> None:
        self._took: deque[float] = deque(maxlen=WINDOW)
        self._started: Optional[float] = None

    def start(self, now: float) -> None:
        self._started = now

    def finish(self, now: float) -> None:
        if self._started is not None:
            self._took.append(max(0.0, now - self._started))
        self._started = None

    def drop(self) -> None:
        self._started = None

    @property
    def in_flight(self) -> bool:
        return self._started is not None

    def expected_end(self) -> Optional[float]:
        """When the bucket in flight should end (None: none in flight, or no bucket timed yet)."""
        if self._started is None or not self._took:
            return None
        return self._started + statistics.median(self._took)

    def ends_by(self, deadline: float, now: float) -> bool:
        """Whether the bucket in flight may still end by ``deadline``: not once it has passed, not when the
        expectation lies past it; unknown (nothing timed) counts as may."""
        if now >= deadline:
            return False
        end = self.expected_end()
        return end is None or end <= deadline


class GroupClocks:
    """Every rank's ``BucketClock``, as the lock server keeps them from the requests it serves: whom a round's end
    still waits for."""

    def __init__(self, world_size: int) -> None:
        self._clocks = [BucketClock() for _ in range(world_size)]

    def after_next(self, rank: int, finished_done: bool, handed_out: bool, now: float) -> None:
        """``rank``'s clock after a ``next``: its bucket finished (``finished_done``) or dropped, the next one
        handed out (``handed_out``)."""
        if not 0 <= rank < len(self._clocks):
            return
        clock = self._clocks[rank]
        if finished_done:
            clock.finish(now)
        else:
            clock.drop()
        if handed_out:
            clock.start(now)

    def ends_by(self, rank: int, deadline: float, now: float) -> bool:
        """Whether ``rank``'s bucket in flight may still end by ``deadline`` (``BucketClock.ends_by``)."""
        return self._clocks[rank].ends_by(deadline, now)

