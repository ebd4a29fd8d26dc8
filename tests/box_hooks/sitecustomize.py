"""A test hook for the cluster box (tests/test_cluster_box.py, tests/test_stages_box.py), loaded by Python at start-up
from the pods' PYTHONPATH.

In the pod whose index is ``BIGGRAPH_BOX_HOLD_INDEX``, while the file ``BIGGRAPH_BOX_HOLD_FILE`` exists, wait (having
touched ``<file>.held``) at the point ``BIGGRAPH_BOX_HOLD_AT`` names:

- ``train`` (the default), in the torchrun worker: after training a bucket, before it goes on to its write-back;
- ``write``, in the torchrun worker: at the start of writing a partition back;
- ``import``, in the import pod: with a unit's files written, before its marker is committed, for the first unit whose
  name starts with ``BIGGRAPH_BOX_HOLD_UNIT`` (``bucket-`` unless set): the moment a pod lost mid-import leaves a
  file that must not be taken as done.

With ``BIGGRAPH_BOX_HOLD_FIRST=1`` (``train`` only), every other pod's trainer waits at its first bucket request
until the held pod holds (at most ``BIGGRAPH_BOX_HOLD_FIRST_S``, 120 s): the held pod is then sure to get a bucket
(a small graph's pass can be trained by one rank alone before another asks for any), and no one holds a lock the
held pod's bucket needs while it waits (it asks before it takes any).

The test freezes or kills the pod there: the moments a stalled or lost node is most dangerous in (a stalled trainer,
woken after the group went on without it, holds rows to write over the others'; a lost importer leaves an
uncommitted file behind). The hold file is removed once the pod is killed, so that its replacement runs on.

``write`` holds only a write-back of the trainer's main thread (the partitions it gives back at the end of a pass,
or evicts in front of a bucket), not one of its background write-back thread: held there, the thaw would set two
threads going at once, the main thread's next lock-server request failing as fast as the held write's round check,
and a request failing first ends the process with the write never tried (safe, but not the moment under test)."""

import os
import threading

_FILE = os.environ.get("BIGGRAPH_BOX_HOLD_FILE")
_AT = os.environ.get("BIGGRAPH_BOX_HOLD_AT", "train")
# a torchrun worker: LOCAL_RANK set, or a warm spare that becomes one (job/train/elastic/spare.py: BIGGRAPH_WARM_SPARE)
_WORKER = "LOCAL_RANK" in os.environ or os.environ.get("BIGGRAPH_WARM_SPARE") == "1"
_THIS_POD = os.environ.get("JOB_COMPLETION_INDEX") == os.environ.get("BIGGRAPH_BOX_HOLD_INDEX")
_FIRST = os.environ.get("BIGGRAPH_BOX_HOLD_FIRST") == "1"
if _FILE and _FIRST and _WORKER and not _THIS_POD and _AT == "train":
    import time

    from job.train.schedule import group

    _next = group.LockServerScheduler.next_bucket
    _asked = []

    def _next_after_the_held(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        if not _asked:
            _asked.append(True)
            deadline = time.monotonic() + float(os.environ.get("BIGGRAPH_BOX_HOLD_FIRST_S", "120"))
            while os.path.exists(_FILE) and not os.path.exists(_FILE + ".held") and time.monotonic() < deadline:
                time.sleep(0.01)
        return _next(self, *args, **kwargs)

    group.LockServerScheduler.next_bucket = _next_after_the_held  # type: ignore[method-assign]
if _FILE and _THIS_POD and (_WORKER or _AT == "import"):
    import time

    def _hold() -> None:
        if os.path.exists(_FILE):
            open(_FILE + ".held", "w").close()
            while os.path.exists(_FILE):
                time.sleep(0.01)

    if _AT == "import":
        from job.data.importing.staging import Staging

        _commit = Staging.commit
        _prefix = os.environ.get("BIGGRAPH_BOX_HOLD_UNIT", "bucket-")

        def _held_commit(self, unit, record):  # type: ignore[no-untyped-def]
            if unit.startswith(_prefix):
                _hold()
            return _commit(self, unit, record)

        Staging.commit = _held_commit  # type: ignore[method-assign]
    elif _AT == "write":
        from job.formats.checkpoint import CheckpointStorage

        _save = CheckpointStorage.save_entity_partition

        def _held_save(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            if threading.current_thread() is threading.main_thread():
                _hold()
            return _save(self, *args, **kwargs)

        CheckpointStorage.save_entity_partition = _held_save  # type: ignore[method-assign]
    else:
        from job.train import bucket_run

        _train = bucket_run.BucketRunner._train

        def _held_train(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            stats = _train(self, *args, **kwargs)
            _hold()
            return stats

        bucket_run.BucketRunner._train = _held_train  # type: ignore[method-assign]
