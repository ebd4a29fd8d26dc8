"""A checkpoint directory's life: who may write it (:mod:`~job.checkpoint.owner`), and in what order a version is
opened, committed and retired (:mod:`~job.checkpoint.manager`). The format itself is :mod:`job.formats.checkpoint`."""

from job.checkpoint.manager import CheckpointManager, Group, ModelState
from job.checkpoint.owner import OwnerBusyError, Ownership, OwnershipLost

__all__ = ["CheckpointManager", "Group", "ModelState", "OwnerBusyError", "Ownership", "OwnershipLost"]
