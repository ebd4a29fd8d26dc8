"""Recovery of an interrupted pass: the group progress a restarted run resumes, with its write groups rolled forward.

Called by the checkpoint manager (job/checkpoint/manager.py) on rank 0 while it cleans the directory, so that every
writer of a checkpoint directory lives in this package: a progress this run resumes keeps the uncommitted files it
names (their staged moves finished first, ``roll_forward``); any other (another run's, a stale one, any found by a
single-process run) is removed before the clean-up removes the files it names, so it never outlives them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

from job.checkpoint.group_progress import Progress, read_progress, remove_progress
from job.checkpoint.write_groups import roll_forward


def recover_pass(checkpoint_path: str, version: int, run_id: Optional[str], *,
                 guard: Optional[Callable[[], None]] = None) -> Optional[Progress]:
    """The lock server's persisted progress of the pass after ``version`` if run ``run_id`` resumes it (None for a
    single-process run), with the publication of the write groups it recorded finished; else None, with any
    progress found removed. ``guard``: the checkpoint's round and owner check, run before anything is written."""
    progress = read_progress(checkpoint_path, version, run_id) if run_id is not None else None
    if progress is None:
        if guard is not None:
            guard()
        remove_progress(checkpoint_path)
    else:
        roll_forward(checkpoint_path, progress.version, progress.staged(), guard=guard)
    return progress
