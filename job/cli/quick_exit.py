"""Ending a finished import process without the interpreter's teardown (issue #46).

Once ``biggraph import`` has returned 0, everything it wrote is closed and committed, yet Python's exit still
collects and deallocates every object and module (numpy, pyarrow, h5py, the config): ~0.04 s of CPU a process,
measured on a small import, which every pod of a parallel import pays. The process entry (``job.cli.entry``) arms
``QuickExit`` before the command runs; at exit, after Python has joined the non-daemon threads and run every exit
handler that the command registered (they run last-registered first, so all of them run before this one), it
flushes the logs and standard streams and ends the process with ``os._exit``. Only for the commands in
``QUICK_EXIT_COMMANDS`` and only on success, and for a trainer whose round ended from outside (``ROUND_ENDED``: the
failure budget's codes, job/train/elastic/budget.py): everything a restart needs is in the store and the progress,
and the threads it abandons (its lock server's, gloo's pairs with a dead peer) made the interpreter's teardown abort
now and then ("terminate called without an active exception", exit -6: 1 in a 100-event chaos run, 1-6 in 30-event
runs with shards, where rank 0's trainer meets a lost peer more often), which the agent counts as a crash and a
restart spent where the round had only ended. Any other exit is Python's own, traceback and all.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys

QUICK_EXIT_COMMANDS = frozenset({"import"})  # a process per pod, by the dozen: their exit is worth shortening
ROUND_ENDED = frozenset({75, 76})  # ``EXIT_ROUND_ENDED``, ``EXIT_ROUND_ENDED_IDLE`` (kept torch-free here)


def allowed(command: str | None, code: int) -> bool:
    """Whether a process of ``command`` that returns ``code`` ends without the interpreter's teardown."""
    return (code == 0 and command in QUICK_EXIT_COMMANDS) or (command == "train" and code in ROUND_ENDED)


class QuickExit:
    """An exit handler that ends the process with ``os._exit(code)`` once ``allow(code)`` was called."""

    def __init__(self) -> None:
        self.code: int | None = None

    def arm(self) -> None:
        """Register the handler; call it before the command registers its own (those must run first)."""
        atexit.register(self._exit)

    def allow(self, code: int) -> None:
        self.code = code

    def _exit(self) -> None:
        if self.code is None:
            return
        logging.shutdown()  # registered before this handler (at logging's import), so it would run after it
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # a closed or broken stream: nothing more can be said on it
                stream.flush()
        os._exit(self.code)
