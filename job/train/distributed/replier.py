"""The lock server's replies, encoded, sealed and pushed by a thread of their own (issue #45).

Why: the serving thread (job/train/distributed/lock_server.py) decides every request of every rank, one after
another, so a rank's round trip at M pods is at least M times its time per bucket (bench/RESULTS.md, "The lock
server's serving thread"). Four replies a bucket each cost it a JSON encoding, a MAC over it and a push into the
store (~0.05-0.1 ms each). None of that needs the state's serialization: once a reply is decided, its bytes depend
only on it and on the request it answers. So the serving thread hands ``(job, reply)`` here and goes on deciding.

Order: one thread, first in first out, so that a client's replies leave in the order the server decided them (a
channel has one request outstanding at a time, and a reply never overtakes one decided before it). A reply may
leave after a transfer posted for the same request (a sum, a pull's rows): the client posts its receive only after
it has read the reply, and a posted send waits for it. The server counts the replies handed here and not yet taken
by this thread (``pending``): it is settled only when none is left, and its ``stop`` waits for every reply decided
before it to be pushed (as the serving thread's own push was waited for before).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Optional

from job.train.distributed import protocol
from job.train.distributed.protocol import Reply

logger = logging.getLogger("biggraph")

__all__ = ["Replier"]


class Replier:
    """``push(job, reply)`` from the serving thread; a thread seals each reply under the scope of the request it
    answers and pushes it to the request's reply queue, in the order pushed. ``stopping``: whether the server is
    stopping (a reply that cannot be pushed then is not worth a warning)."""

    def __init__(self, store: Any, prefix: str, stopping: Callable[[], bool],
                 pushed: Callable[[Any], None] = lambda job: None) -> None:
        self.store = store  # the replies' own connection (a store client serves one call at a time)
        self.prefix = prefix
        self._stopping = stopping
        self._pushed = pushed  # told each request whose reply was pushed (request_trace.py: its last stamp)
        self._queue: queue.SimpleQueue[Optional[tuple[Any, Reply]]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self.pending = 0  # replies handed here and not yet taken by the thread
        self.cpu_s = 0.0  # this thread's CPU time on replies (``time.thread_time``)
        self.pushed = 0
        self.thread = threading.Thread(target=self._run, name="biggraph-lock-replies", daemon=True)
        self.thread.start()

    def push(self, job: Any, reply: Reply) -> None:
        """Answer ``job`` (a ``Waiting``: its envelope and reply queue) with ``reply``, after every reply pushed
        before it."""
        with self._lock:
            self.pending += 1
        self._queue.put((job, reply))

    def idle(self) -> bool:
        """Whether every reply handed here has been taken to be pushed (``stop`` waits for the push)."""
        with self._lock:
            return self.pending == 0

    def stop(self, timeout_s: float = 5.0) -> None:
        """Push what is queued, then end the thread."""
        self._queue.put(None)
        self.thread.join(timeout=timeout_s)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            started = time.thread_time()
            if item is None:
                return
            with self._lock:  # taken: a client that has its reply finds the server settled (``stop`` still waits
                self.pending -= 1  # for this push)
            self._send(*item)
            with self._lock:
                self.pushed += 1
                self.cpu_s += time.thread_time() - started

    def _send(self, job: Any, reply: Reply) -> None:
        """Seal and push one reply; one that cannot be pushed (the store going away with the round) is logged,
        never fatal."""
        try:
            envelope = job.incoming.envelope
            scope = protocol.reply_scope(self.prefix, envelope.rank, envelope.channel, envelope.seq)
            self.store.queue_push(job.reply_to, protocol.encode_reply(reply, scope=scope))
            self._pushed(job)
        except Exception as err:  # noqa: BLE001
            if not self._stopping():
                logger.warning("lock server: could not answer rank %s's %s (%s)", job.rank, job.incoming.op, err)
