"""A test hook for the cluster box (tests/test_cluster_box.py), loaded by Python at start-up from the pods' PYTHONPATH.

In the torchrun worker of the pod whose index is ``BIGGRAPH_BOX_HOLD_INDEX``, while the file
``BIGGRAPH_BOX_HOLD_FILE`` exists, wait (having touched ``<file>.held``): after training a bucket, before it goes on
to its write-back (``BIGGRAPH_BOX_HOLD_AT=train``, the default), or at the start of writing a partition back
(``write``). The test freezes the pod there: the moments a stalled node's trainer is most dangerous in, since,
woken after the group went on without it, it holds rows to write over the others'.

``write`` holds only a write-back of the trainer's main thread (the partitions it gives back at the end of a pass,
or evicts in front of a bucket), not one of its background write-back thread: held there, the thaw would set two
threads going at once, the main thread's next lock-server request failing as fast as the held write's round check,
and a request failing first ends the process with the write never tried (safe, but not the moment under test)."""

import os
import threading

_FILE = os.environ.get("BIGGRAPH_BOX_HOLD_FILE")
# a torchrun worker: LOCAL_RANK set, or a warm spare that becomes one (job/train/elastic/spare.py: BIGGRAPH_WARM_SPARE)
_WORKER = "LOCAL_RANK" in os.environ or os.environ.get("BIGGRAPH_WARM_SPARE") == "1"
if _FILE and _WORKER and os.environ.get("JOB_COMPLETION_INDEX") == os.environ.get("BIGGRAPH_BOX_HOLD_INDEX"):
    import time

    from job.formats.checkpoint import CheckpointStorage
    from job.train import bucket_run

    def _hold() -> None:
        if os.path.exists(_FILE):
            open(_FILE + ".held", "w").close()
            while os.path.exists(_FILE):
                time.sleep(0.01)

    if os.environ.get("BIGGRAPH_BOX_HOLD_AT", "train") == "write":
        _save = CheckpointStorage.save_entity_partition

        def _held_save(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            if threading.current_thread() is threading.main_thread():
                _hold()
            return _save(self, *args, **kwargs)

        CheckpointStorage.save_entity_partition = _held_save  # type: ignore[method-assign]
    else:
        _train = bucket_run.BucketRunner._train

        def _held_train(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            stats = _train(self, *args, **kwargs)
            _hold()
            return stats

        bucket_run.BucketRunner._train = _held_train  # type: ignore[method-assign]
