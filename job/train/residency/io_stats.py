"""``IOStats``: what a pass read and wrote of its partitions, and how long training waited for it (the pass record's
I/O figures, job/train/pass_stats.py)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class IOStats:
    """Partition traffic of one pass (thread-safe: the background thread adds to it)."""

    loads: int = 0  # partitions brought into memory: read, or initialised on their first use
    reads: int = 0
    writes: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    prefetched: int = 0  # loads read in the background before the bucket needing them started (off the critical path)
    written_behind: int = 0  # writes of evicted partitions done in the background while a bucket trained
    blocked_seconds: float = 0.0  # training waited for partition I/O (swaps, not the commit)
    commit_seconds: float = 0.0  # writing every partition into the new version at the end of the pass
    # partition_handoff (job/train/distributed/handoff.py): loads taken from another rank's memory, and from this one's
    handed_in: int = 0
    bytes_handed_in: int = 0
    kept_hits: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, *, loads: int = 0, reads: int = 0, writes: int = 0, bytes_read: int = 0, bytes_written: int = 0,
            prefetched: int = 0, written_behind: int = 0, handed_in: int = 0, bytes_handed_in: int = 0,
            kept_hits: int = 0) -> None:
        with self._lock:
            self.handed_in += handed_in
            self.bytes_handed_in += bytes_handed_in
            self.kept_hits += kept_hits
            self.prefetched += prefetched
            self.written_behind += written_behind
            self.loads += loads
            self.reads += reads
            self.writes += writes
            self.bytes_read += bytes_read
            self.bytes_written += bytes_written

    def as_record(self) -> dict[str, float]:
        handoff = {"partition_handoffs": self.handed_in, "bytes_handed_over": self.bytes_handed_in,
                   "partition_kept_hits": self.kept_hits} if self.handed_in or self.kept_hits else {}
        return {**handoff, "partition_loads": self.loads, "partition_reads": self.reads, "partition_writes": self.writes,
                "bytes_read": self.bytes_read, "bytes_written": self.bytes_written,
                "partition_loads_prefetched": self.prefetched,
                "partition_writes_background": self.written_behind,
                "io_blocked_seconds": round(self.blocked_seconds, 3),
                "commit_seconds": round(self.commit_seconds, 3)}
