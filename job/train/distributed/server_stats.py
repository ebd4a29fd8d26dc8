"""What the lock server's one serving thread spends its time on: the figures that say how far it is from saturating.

The server (job/train/distributed/lock_server.py) is one thread on rank 0 serving every rank, so its busy time per request
bounds how many trainers one group can have (bench/lock_server_bench.py measures it, bench/RESULTS.md models it).
Counted with ``time.perf_counter`` around each step (a few hundred nanoseconds a request, against the tens of
microseconds a request costs); read with ``LockServer.stats()`` and logged at the end of a pass.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ServerStats:
    """Seconds of the serving thread, in total (``busy_s``, every event it handled) and per request kind
    (``ops``: kind -> [count, seconds judging it: the state's logic and its progress write]), of which
    ``progress_s`` went to progress writes (``appends``, ``shared_appends`` of them carrying the vector), and
    ``copy_s`` to copying sums into their transfer slots."""

    busy_s: float = 0.0
    cpu_s: float = 0.0  # of it on a CPU (``time.thread_time``): the rest waited for a CPU or the GIL
    events: int = 0
    batches: int = 0  # passes of the serving loop, each over the events queued then (``events`` in all)
    largest_batch: int = 0
    ops: dict[str, list[float]] = field(default_factory=dict)
    progress_s: float = 0.0
    appends: int = 0
    shared_appends: int = 0
    copy_s: float = 0.0

    def judged(self, op: str, seconds: float) -> None:
        entry = self.ops.setdefault(op, [0, 0.0])
        entry[0] += 1
        entry[1] += seconds

    def persisted(self, seconds: float, with_shared: bool) -> None:
        self.progress_s += seconds
        self.appends += 1
        self.shared_appends += int(with_shared)

    def as_dict(self) -> dict[str, Any]:
        return {"busy_s": self.busy_s, "cpu_s": self.cpu_s,
                "events": self.events, "batches": self.batches, "largest_batch": self.largest_batch,
                "progress_s": self.progress_s, "appends": self.appends,
                "shared_appends": self.shared_appends, "copy_s": self.copy_s,
                "ops": {op: {"count": int(n), "seconds": s} for op, (n, s) in self.ops.items()}}


class Stopwatch:
    """``with Stopwatch() as watch: ...; watch.seconds``."""

    def __enter__(self) -> Stopwatch:
        self.started = time.perf_counter()
        self.cpu_started = time.thread_time()
        self.seconds = self.cpu_seconds = 0.0
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.started
        self.cpu_seconds = time.thread_time() - self.cpu_started  # this thread's CPU time in the block
