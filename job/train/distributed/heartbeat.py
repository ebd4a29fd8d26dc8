"""The heartbeat: every rank beats in the round's store, and rank 0 declares dead a peer whose beats stop.

Authenticated (issue 44): a beat is the key ``biggraph/<round>/heartbeat/<rank>`` set to ``<count> <mac>``, the count
growing by one per beat and the MAC over the round, the rank and the count under the group's secret
(job/train/distributed/auth.py). Rank 0 counts a beat only when its MAC holds and its count is above the last one it
counted. Before, the beat was a counter anyone could ``add`` to: a client of rank 0's store that bumped a frozen
peer's counter (a SIGSTOPped process keeps its liveness connection open, so only the heartbeat finds it) hid it for
as long as it kept bumping, and the group waited on the frozen peer's partitions. Now what such a client writes is
either refused (no MAC, a count that is not the peer's) or a replay of a beat already counted: the frozen peer is
declared dead after the peer timeout whatever it writes. Rank 0 reads a beat with a compare-and-set that changes
nothing (``read_beat``): a plain ``get`` of a key that someone deleted would block for the store's timeout (30 min).

What a forger can still do is the store's own weakness, not the beat's: overwrite or delete a live peer's beat until
rank 0 declares it dead (a group restart, never data: docs/security.md).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Optional

from job.train.distributed import auth

logger = logging.getLogger("biggraph")

# How fast rank 0 gives up on a silent peer (env BIGGRAPH_PEER_INTERVAL / BIGGRAPH_PEER_TIMEOUT). The timeout
# is the first term of the recovery time after a lost pod (bench/elastic_bench.py: 15 s of a 47 s recovery
# before). 6 s is six missed beats: a beat comes from its own thread and only needs the GIL for a moment,
# so it survives partition writes and training (measured: torch.save of a 400 MB optimizer state holds the
# GIL for 0.4 s, h5py reads and writes and torch kernels release it). A false alarm costs a group restart
# (about 20 s) and the in-flight buckets, never data.
DEFAULT_PEER_INTERVAL_S = 1.0
DEFAULT_PEER_TIMEOUT_S = 6.0

# How long rank 0 waits for a peer's first beat (``Heartbeat``): a starting peer may take 10 s to connect its
# heartbeat to the store (a dropped reverse-DNS query and its retry), more on a starved node
FIRST_BEAT_TIMEOUT_S = 60.0


# what rank 0's non-blocking read of a beat compares against: never a beat's value (a beat starts with a digit)
_ABSENT = "\x00absent"


def round_key(round_id: str, name: str) -> str:
    """The store key ``name`` of round ``round_id`` (every key of ours lives under its round)."""
    return f"biggraph/{round_id}/{name}"


def beat_value(round_id: str, rank: int, count: int) -> str:
    """What rank ``rank`` writes as its ``count``-th beat of round ``round_id``: the count and its MAC."""
    return f"{count} {auth.mac('heartbeat', round_id, str(rank), str(count))}"


def beat_count(value: str, round_id: str, rank: int) -> int:
    """The count of a beat as read from the store, 0 when it is not rank ``rank``'s authentic beat of this round
    (absent, malformed, forged, or another rank's or round's)."""
    count, _, proof = value.partition(" ")
    if not count.isdigit() or not auth.verify(proof, "heartbeat", round_id, str(rank), count):
        return 0
    return int(count)


def read_beat(store: Any, round_id: str, rank: int) -> int:
    """Rank ``rank``'s last authentic beat count in the store (0: none yet, or what is there is not authentic),
    without blocking: a compare-and-set against a value no beat has changes nothing and answers what is there
    (``_ABSENT`` when the key is missing), where a ``get`` of a missing key waits for the store's timeout."""
    raw = store.compare_set(round_key(round_id, f"heartbeat/{rank}"), _ABSENT, _ABSENT)
    value = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
    return 0 if value == _ABSENT else beat_count(value, round_id, rank)


class Heartbeat:
    """Every rank beats in the store (an authenticated, growing count: the module's docstring); rank 0 notices a
    rank whose count stops growing.

    torchrun's agents do not restart survivors when a node dies and no collective is pending (our
    trainers only talk to the store), so without this the survivors would wait for its bucket forever.

    A peer is judged from its first beat on: until then it has ``first_beat_after`` (at least a minute) to show
    up. Its first beat comes once its heartbeat has its own store connection, and connecting is what a starting
    group can stall on: torch's store client looks the server's address up in reverse DNS on every connection, and
    a resolver that drops a query costs 5 s (10 s with its retry) before the connection is made (seen on the bench
    VMs: about one query in 25-50 of a burst; bench/RESULTS.md, "A group's start-up"; where the lookup fails torch
    warns ``[c10d] The hostname of the client socket cannot be retrieved. err=-3``). Judged from rank 0's own
    start instead, such a peer, alive and starting, was declared dead after 6 s and the whole group restarted. A
    peer that dies before its first beat is still found, after ``first_beat_after``; one that dies after it, after
    ``dead_after`` as before. The window between the two is the few moments from the group's last collective
    (``init_distributed``) to the peer's first beat.
    """

    def __init__(self, store: Any, rank: int, world_size: int, interval: float = DEFAULT_PEER_INTERVAL_S,
                 dead_after: float = DEFAULT_PEER_TIMEOUT_S, round_id: str = "0",
                 first_beat_after: float = FIRST_BEAT_TIMEOUT_S) -> None:
        self.store = store.clone()
        self.round_id = round_id
        self.rank = rank
        self.world_size = world_size
        self.interval = interval
        self.dead_after = dead_after
        self.first_beat_after = max(first_beat_after, dead_after)
        self.dead_rank: Optional[int] = None  # the first peer declared dead
        self._dead: set[int] = set()  # every peer declared dead (each fenced: ``DistributedContext.fence``)
        self.silent_for = dead_after  # how long the dead rank was silent before it was declared dead
        self._started = time.monotonic()
        self._last_run = self._started  # when the beat thread last ran (``stalled``)
        self._stalled_for = 0.0  # the longest gap between two of its runs past ``dead_after`` (latched)
        self._last_change: dict[int, float] = {}  # rank 0: when each peer's counter last moved
        self._count = 0  # this rank's beats so far (each one's value carries it: ``beat_value``)
        self._declare_lock = threading.Lock()  # ``lost`` declares from the liveness watcher's thread
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="biggraph-heartbeat", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        started = self._started
        last_value: dict[int, int] = {}
        last_change = self._last_change
        while True:  # the first beat at once: the watcher judges this rank from it on
            now = time.monotonic()
            if now - self._last_run > self.dead_after:  # this process (or its store) stalled past the peer timeout
                self._stalled_for = max(self._stalled_for, now - self._last_run)
            self._last_run = now
            try:
                self._count += 1
                self.store.set(round_key(self.round_id, f"heartbeat/{self.rank}"),
                               beat_value(self.round_id, self.rank, self._count))
                if self.rank == 0:
                    self._watch(started, last_value, last_change)
            except Exception:  # the store is gone: the main thread will fail on its next call
                return
            if self._stop.wait(self.interval):
                return

    def _watch(self, started: float, last_value: dict[int, int], last_change: dict[int, float]) -> None:
        """Rank 0: declare dead a peer silent for ``dead_after`` since its last beat, or one that has not beaten
        ``first_beat_after`` after this watcher started."""
        now = time.monotonic()
        for peer in range(1, self.world_size):
            value = read_beat(self.store, self.round_id, peer)
            if value == 0 and peer not in last_value:  # not started yet (or nothing authentic written)
                if now - started > self.first_beat_after:
                    self._declare(peer, self.first_beat_after)
            elif value > last_value.get(peer, 0):  # a new authentic beat: a replayed or forged one is not
                last_value[peer] = value
                last_change[peer] = now
            elif now - last_change[peer] > self.dead_after:
                self._declare(peer, self.dead_after)

    def _declare(self, peer: int, silent_for: float) -> None:
        """Fence ``peer`` (should it wake up, it writes nothing: ``fence``) before the lock server learns it is
        dead (``dead_ranks``) and refuses its requests. Called from the heartbeat's thread and, through ``lost``,
        from the liveness watcher's."""
        with self._declare_lock:
            if peer in self._dead:
                return
            self.store.set(round_key(self.round_id, f"dead/{peer}"), auth.mac("dead", self.round_id, str(peer)))
            if self.dead_rank is None:
                self.silent_for = silent_for
                self.dead_rank = peer
            self._dead = self._dead | {peer}  # a new set: read from other threads without a lock

    def stalled(self) -> float:
        """How long this process went without a beat past the peer timeout (0: never): a process stopped (SIGSTOP, a
        paused VM, a starved node) or cut off from rank 0's store for that long has been declared dead by the others
        (rank 0 of it, or it of rank 0), whose round went on without it. Latched by the beat thread when it wakes;
        read as it stands otherwise (the writer may wake before the beat thread does)."""
        gap = time.monotonic() - self._last_run
        return max(self._stalled_for, gap if gap > self.dead_after + self.interval else 0.0)

    def dead_ranks(self) -> frozenset[int]:
        """Every peer declared dead so far."""
        return frozenset(self._dead)

    def lost(self, peer: int) -> None:
        """Rank 0: declare ``peer`` dead now, as a silent one is: its process is gone (its liveness connection
        closed without a goodbye, job/train/distributed/liveness.py), so waiting out the peer timeout would only delay the next
        group. ``silent_for`` is then the time since its counter last moved."""
        since = self._last_change.get(peer, self._started)
        self._declare(peer, time.monotonic() - since)

    def stop(self) -> None:
        """Stop beating, and wait (briefly) for a store call in flight: a process that exits while its heartbeat
        thread is inside torch's store client is aborted (``terminate called without an active exception``) and
        torchrun counts the worker as failed."""
        self._stop.set()
        if self.thread is not threading.current_thread():
            self.thread.join(timeout=self.interval + 5.0)
