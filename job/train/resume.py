"""Resume: the model state a run starts from, and the torchrun group as the checkpoint manager sees it.

Which version is committed and what a killed run left is the checkpoint manager's (job/checkpoint/manager.py);
here it is decided whether the relation parameters come from that version, from ``init_path`` or from a fresh
initialisation. The loop itself then only ever moves forward from ``version``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Optional

from job.checkpoint.group_progress import Progress, read_progress, remove_progress
from job.checkpoint.write_groups import roll_forward
from job.config import ConfigSchema
from job.errors import CheckpointError
from job.formats.checkpoint import CheckpointStorage, SharedSumRegistry
from job.model.scoring import Model
from job.train.batch.optim import RelationAdagrad
from job.train.distributed.group import DistributedContext, wait_all

logger = logging.getLogger("biggraph")



class GroupBarrier:
    """A torchrun group as the checkpoint manager sees it (``job.checkpoint.Group``): its rank, the run it trains
    for (one writer), barriers of this round, and the store where ranks share the records of the files they write."""

    def __init__(self, dist: DistributedContext) -> None:
        self.dist = dist
        self.rank = dist.rank

        self.run_id = dist.run_id

    def barrier(self, name: str) -> None:
        wait_all(self.dist, name)  # under this round's keys (job/train/distributed/group.py)

    def shared_sums(self) -> SharedSumRegistry:
        return SharedSumRegistry(self.dist.store, self.dist.round_id)


def progress_to_resume(checkpoint_path: str, version: int, dist: Optional[DistributedContext], *,
                       guard: Optional[Callable[[], None]] = None) -> Optional[Progress]:
    """(Rank 0, while the checkpoint manager cleans the directory.) The lock server's persisted progress of the pass
    after ``version`` if this run resumes it, with the publication of the write groups it recorded finished
    (``roll_forward``: before the manager's clean-up removes staged files). One it does not resume (another run's,
    a stale one, any found by a single-process run) is removed first, so that it never outlives the uncommitted
    files it names."""
    progress = read_progress(checkpoint_path, version, dist.run_id) if dist is not None else None
    if progress is None:
        if guard is not None:
            guard()
        remove_progress(checkpoint_path)
    else:
        roll_forward(checkpoint_path, progress.version, progress.staged(), guard=guard)
    return progress


def load_model_state(model: Model, optimizer: RelationAdagrad, checkpoint: CheckpointStorage, version: int,
                     config: ConfigSchema) -> None:
    """The relation parameters and their Adagrad sums of the committed ``version``; with none committed,
    those of ``config.init_path``'s latest version if it has a model; else the model keeps its initialisation."""
    if version > 0:
        if not checkpoint.has_model(version):
            raise CheckpointError(
                f"{checkpoint.model_file(version)}: missing although checkpoint_version.txt names "
                f"version {version}"
            )
        params, optim_state, _ = checkpoint.load_model(version)
        model.load_public_state_dict(params, checkpoint.model_file(version))
        optimizer.load_state_dict(optim_state, checkpoint.model_file(version))
        logger.info("resuming from checkpoint version %d in %s", version, config.checkpoint_path)
    elif config.init_path:
        init = CheckpointStorage(config.init_path)
        init_version = init.load_version()
        if init.has_model(init_version):
            params, optim_state, _ = init.load_model(init_version)
            model.load_public_state_dict(params, init.model_file(init_version))
            load_init_optimizer(optimizer, optim_state, init.model_file(init_version))
        logger.info("initialising embeddings from %s", config.init_path)


def load_init_optimizer(optimizer: RelationAdagrad, optim_state: Optional[dict[str, Any]], where: str) -> None:
    """The relation parameters' Adagrad sums from ``init_path``, as PBG 1.0.0 loads them
    (torchbiggraph/train.py, train_and_report_stats: ``global_optimizer.load_state_dict``). A model of
    another shape (other relations or operators) keeps its values loaded where they fit and zero sums."""
    try:
        optimizer.load_state_dict(optim_state, where)
    except CheckpointError as err:
        for s in optimizer.sums:
            s.zero_()
        optimizer.steps.zero_()
        logger.warning("init_path: relation optimizer state not loaded (%s); starting with zero sums", err)
