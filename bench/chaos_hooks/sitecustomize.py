"""The chaos bench's counter of shared updates (bench/chaos_bench.py), loaded by Python at start-up from the pods'
PYTHONPATH.

Why: whether every shared-parameter update of a bucket reaches the committed model once cannot be told from trained
values (Hogwild training is not reproducible). So the bench adds a relation that has no edges (``translation``: its
vector starts at zero and no batch ever gives it a gradient), and in every torchrun worker this hook adds exactly 1.0
to that vector after each bucket the trainer trains: to element 0 always, and to element 1 + the bucket's lhs
partition. The addition is a change of a shared parameter like any training update: it travels to the lock server
with the request that finishes the bucket, is made persistent when the bucket is saved, and is dropped with the
bucket when a lost trainer's bucket is redone. A committed version ``v`` of a run without lost or doubled updates
holds ``v * P * P`` in element 0 and ``v * P`` in each element 1 + l.

Active only in a torchrun worker (``LOCAL_RANK`` set, or a warm spare that becomes one: ``BIGGRAPH_WARM_SPARE``,
job/train/elastic/spare.py) with ``BIGGRAPH_CHAOS_COUNTER`` naming the relation's index (with
``BIGGRAPH_CHAOS_COUNTER_DYNAMIC=1``: its row in the dynamic relations' one operator table, which no training edge
names, so no batch gives it a gradient and the sparse exchange pushes its changes without ever pulling it).
"""

import os

_COUNTER = os.environ.get("BIGGRAPH_CHAOS_COUNTER")
if _COUNTER is not None and ("LOCAL_RANK" in os.environ or os.environ.get("BIGGRAPH_WARM_SPARE") == "1"):
    import torch

    from job.train import bucket_run

    _run = bucket_run.BucketRunner.run

    def _counted_run(self, iteration, bucket, *args, **kwargs):  # type: ignore[no-untyped-def]
        result = _run(self, iteration, bucket, *args, **kwargs)
        if os.environ.get("BIGGRAPH_CHAOS_COUNTER_DYNAMIC") == "1":  # a row of the one operator's table
            vector = self.model.rhs_operators[0].translations[int(_COUNTER)]
        else:
            vector = self.model.rhs_operators[int(_COUNTER)].translation
        with torch.no_grad():
            vector[0] += 1.0
            vector[1 + bucket.lhs] += 1.0
        return result

    bucket_run.BucketRunner.run = _counted_run  # type: ignore[method-assign]
