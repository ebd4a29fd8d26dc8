"""Resume: open a checkpoint directory at its committed version and load the model state a run starts from.

Separate from ``Trainer`` (job/train/loop.py) because it is the one place that decides what a run
starts from: which version is committed, what a killed run left that must go (temporary files, the
uncommitted leftovers of a crashed pass, a newer manifest, stats lines past the marker), and whether the
relation parameters come from that version, from ``init_path`` or from a fresh initialisation. The
loop itself then only ever moves forward from ``version``.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import storage_adapters as storage
from job.config import ConfigSchema
from job.errors import CheckpointError
from job.formats.checkpoint import CheckpointStorage, SharedSumRegistry
from job.model.scoring import Model
from job.train.group import DistributedContext, wait_all
from job.train.optim import RelationAdagrad
from job.train.progress import Progress, read_progress, remove_progress

logger = logging.getLogger("biggraph")

PartKey = tuple[str, int]


def open_checkpoint(checkpoint: CheckpointStorage, checkpoint_path: str, dist: Optional[DistributedContext],
                    all_keys: list[PartKey]) -> tuple[int, Optional[Progress]]:
    """Read the committed version and clean what killed runs left (rank 0 cleans, the others wait).

    Returns the version and, in a torchrun group, the lock server's persisted progress of an interrupted
    pass (its first pass resumes it), else None."""
    rank = dist.rank if dist is not None else 0
    if rank == 0:
        checkpoint.prepare()
    if dist is not None:
        wait_all(dist, "prepared")
    version = checkpoint.load_version()
    # distributed: the lock server's persisted state of an interrupted pass, resumed by its first pass
    progress = read_progress(checkpoint_path, version, dist.run_id) if dist is not None and rank == 0 else None
    if dist is not None:
        # a partition written by one rank is read by others: they verify it against the writer's record
        checkpoint.sums = SharedSumRegistry(dist.store, dist.round_id)
    if rank == 0:
        remove_temporary_files(checkpoint_path)
        checkpoint.drop_uncommitted_manifests(version)
        # a kill between a commit and the clean-up after it leaves the previous version's files and, before
        # the marker, the stats lines of a version that never committed
        checkpoint.drop_older(version, all_keys)
        checkpoint.trim_stats(version)
        if progress is None:
            # leftovers of a pass that crashed before its commit are garbage, and so is a progress this run does
            # not resume (another run's, or a stale one): it goes first, so that it never outlives the files it names
            remove_progress(checkpoint_path)
            checkpoint.drop_uncommitted(version, all_keys)
    if dist is not None:
        wait_all(dist, "cleaned")
    return version, progress


def remove_temporary_files(checkpoint_path: str) -> None:
    """Files a killed writer left under their temporary names are never part of any version; local
    staging copies of uploads a killed trainer never finished are only wasted disk."""
    for path in storage.remove_stale_upload_dirs():
        logger.info("removed %s (left by a trainer that was killed during an upload)", path)
    for name in storage.listdir(checkpoint_path):
        if name.startswith(".tmp-"):
            storage.remove(storage.join(checkpoint_path, name))


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
