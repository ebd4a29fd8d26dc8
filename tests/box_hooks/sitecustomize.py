"""A test hook for the cluster box (tests/test_cluster_box.py), loaded by Python at start-up from the pods' PYTHONPATH.

In the torchrun worker of the pod whose index is ``BIGGRAPH_BOX_HOLD_INDEX``: after training a bucket, while the
file ``BIGGRAPH_BOX_HOLD_FILE`` exists, wait (having touched ``<file>.held``) before the bucket goes on to its
write-back. The test freezes the pod there, so that the trainer is stopped between training a bucket and writing
its partitions back, the moment a stalled node's trainer is most dangerous in: woken after the group went on
without it, it holds rows to write over the others'."""

import os

_FILE = os.environ.get("BIGGRAPH_BOX_HOLD_FILE")
if _FILE and "LOCAL_RANK" in os.environ and os.environ.get("JOB_COMPLETION_INDEX") == os.environ.get(
        "BIGGRAPH_BOX_HOLD_INDEX"):
    import time

    from job.train import bucket_run

    _train = bucket_run.BucketRunner._train

    def _held_train(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        stats = _train(self, *args, **kwargs)
        if os.path.exists(_FILE):
            open(_FILE + ".held", "w").close()
            while os.path.exists(_FILE):
                time.sleep(0.01)
        return stats

    bucket_run.BucketRunner._train = _held_train  # type: ignore[method-assign]
