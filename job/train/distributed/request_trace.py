"""Where a lock request's round trip goes (issue #45): stamps taken on the lock server's threads as a request
passes through them, kept only when the server is asked to (``LockServer(trace=True)``: the bench).

Why: the ``next`` round trip's p99 at 128 pods is hundreds of ms while the serving thread is 1-2% busy
(bench/RESULTS.md, "The lock server's serving thread, batched"): the time is spent somewhere between the threads
(the reader, the serving thread's inbox, the transfer of the change, the committer's group commit and its fsync, the
replier, the client). Each stage below is a ``time.monotonic()`` reading, a clock shared by every process of the
machine on Linux, so a client's own readings (when it asked, when it had its answer) line up with the server's.

A request's marks, in the order a request that is committed passes them (a request answered at once has no
committer marks; ``durable`` may come after ``answered`` for a reply that leaves before its record is stored):

- ``popped``: the reader thread took it off the store's queue;
- ``inbox``: the reader checked it (MAC, fields) and queued it for the serving thread;
- ``taken``: the serving thread took it up;
- ``judged``: its change, if any, has arrived and the serving thread decides it;
- ``submitted``: decided, handed to the committer (or, with nothing to store, to the replier);
- ``commit_start``: the committer began the batch it is in;
- ``added``: the batch's vector work is done (its sum copied);
- ``durable``: the batch's progress write returned;
- ``answered``: the serving thread handed its reply to the replier;
- ``pushed``: the replier pushed the sealed reply into the client's queue.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Optional

__all__ = ["MARKS", "Traces", "mark"]

MARKS = ("popped", "inbox", "taken", "judged", "submitted", "commit_start", "added", "durable", "answered", "pushed")


def mark(marks: Optional[dict[str, float]], name: str) -> None:
    """Stamp ``name`` now, the first time only (a request judged after waiting for a buffer keeps its first
    stamp); nothing when the request is not traced."""
    if marks is not None and name not in marks:
        marks[name] = time.monotonic()


class Traces:
    """The traced requests whose replies have been pushed: ``(op, rank, channel, seq, marks)`` each, read with
    ``take``. ``enabled`` False: ``begin`` gives None and nothing is ever kept (a server's normal run)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._done: list[tuple[str, int, str, int, dict[str, float]]] = []
        self._lock = threading.Lock()

    def begin(self) -> Optional[dict[str, float]]:
        """A new request's marks, ``popped`` stamped (None when not tracing)."""
        return {"popped": time.monotonic()} if self.enabled else None

    def finish(self, job: Any) -> None:
        """``job`` (a ``Waiting``) was answered and its reply pushed: keep its marks."""
        marks = getattr(job, "marks", None)
        if marks is None:
            return
        mark(marks, "pushed")
        envelope = job.incoming.envelope
        with self._lock:
            self._done.append((job.incoming.op, envelope.rank, envelope.channel, envelope.seq, marks))

    def take(self) -> list[tuple[str, int, str, int, dict[str, float]]]:
        """Every trace kept so far (and forget them)."""
        with self._lock:
            done, self._done = self._done, []
        return done
