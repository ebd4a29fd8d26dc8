"""The failure budget: a membership change (a pod lost, replaced, added or deleted) does not spend what a crash loop
spends.

Why: torchrun spends one of its ``--max-restarts`` every time a worker group fails, and every peer loss fails
every survivor's worker on purpose (the round ends, each rank gives back what it holds and exits non-zero so that
torchrun re-forms the group: job/train/schedule/group.py). With the chart's ``maxRestarts: 3`` the fourth pod lost
in a job's life, however long and however healthy, failed every pod (issue 44). Raising ``maxRestarts`` instead
would let a real crash loop (a bug that fails every round at once) restart for as long.

How: a worker tells its agent why it exits, by its exit code (the only channel torchrun reads):

- ``EXIT_ROUND_ENDED`` (75): its round ended from outside (a peer lost or declared dead, a SIGTERM, fenced by
  the new round) after the group made progress in it, as this process saw: it finished a bucket, or the server's
  replies showed partitions written by others since its first one, or a pass committed. A membership change: the
  agent (job/train/elastic/agent.py) restarts the group without spending the budget.
- ``EXIT_ROUND_ENDED_IDLE`` (76): the same, but the round made no progress that this process saw. It spends the
  budget like a crash: a loop of rounds that each end before any work is done (a rank falsely declared dead over
  and over, a peer that dies at every start) is a crash loop too, whatever its cause, and must end. (Group-wide,
  not this process's own buckets: a rank that waits for a bucket while the others train, common with few
  partitions, is in a productive round too.)
- anything else non-zero: a crash, spending the budget as torchrun always did.

A round that made progress cannot loop forever without the job advancing, so only rounds that achieved nothing
are counted. The budget is torchrun's own ``--max-restarts`` (never refilled). Torch-free: the command line
imports it to map the trainer's exceptions to these codes.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass

EXIT_ROUND_ENDED = 75  # the round ended from outside after progress: a membership change, free
EXIT_ROUND_ENDED_IDLE = 76  # the round ended from outside with nothing done: spends the budget
# The pod's launcher (job/train/elastic/agent.py) exits with this when its rendezvous is gone while this node's
# workers were healthy: the c10d store's host pod was lost. docker/entrypoint.sh passes it on only for a pod that
# does not host the store (the host's own failure is counted), and the chart's podFailurePolicy ignores it.
EXIT_RENDEZVOUS_LOST = 77
# docker/entrypoint.sh exits with this when the pod was stopped from outside (SIGTERM: deleted, drained); ignored by
# the chart's podFailurePolicy (the container runtime reports SIGTERM's own 128 + 15 the same way)
EXIT_STOPPED = 143

_progress_lock = threading.Lock()
_progress = 0  # signs of the group's progress this process saw (one process serves one round: torchrun restarts it)


def note_progress() -> None:
    """Count a sign of progress in this round (the lock-server scheduler calls it: a bucket this rank finished,
    partitions others wrote, a pass committed)."""
    global _progress
    with _progress_lock:
        _progress += 1


def progress_seen() -> int:
    return _progress


def round_ended_exit_code() -> int:
    """The exit code of a worker whose round ended from outside (see the module docstring)."""
    return EXIT_ROUND_ENDED if _progress > 0 else EXIT_ROUND_ENDED_IDLE


@dataclass(frozen=True)
class Verdict:
    """What the agent does about a failed worker group."""

    free: bool  # restart without spending the budget
    why: str


def judge(exit_codes: Iterable[int]) -> Verdict:
    """The verdict on a worker group whose failed workers exited with ``exit_codes`` (one per failed local worker):
    free only when every one ended its round after progress; a single crash among them spends."""
    codes = sorted(set(exit_codes))
    if codes and all(code == EXIT_ROUND_ENDED for code in codes):
        return Verdict(True, "the round ended from outside after progress (a membership change)")
    if codes and all(code in (EXIT_ROUND_ENDED, EXIT_ROUND_ENDED_IDLE) for code in codes):
        return Verdict(False, "the round ended before it made any progress this node saw")
    return Verdict(False, f"worker exit code(s) {', '.join(map(str, codes)) or 'unknown'}")
