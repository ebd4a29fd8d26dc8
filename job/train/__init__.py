"""Training: epochs -> edge sets -> edge chunks -> buckets -> Hogwild workers -> batches, alone or in a torchrun group.

``train(config)`` is what ``biggraph train`` runs. It resumes from the last committed
checkpoint; every edge chunk pass ends with a new committed version (PBG's rhythm),
so a crash loses at most the pass in flight. The package's map: docs/ARCHITECTURE.md (the trainer in trainer.py,
a bucket in bucket_run.py, a batch in batch/, the group's mechanics in distributed/, the agent's in elastic/).

The trainer's names load torch, so they are resolved on first use (PEP 562): torch-free modules of this package
(``residency/budget.py``: what a pod needs, read by ``biggraph submit``) import without it, and ``import job.cli``
stays instant.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from job.session import storage_scoped

if TYPE_CHECKING:
    from job.train.trainer import Collaborators, PassPlan, Trainer

_TRAINER_NAMES = ("Collaborators", "PassPlan", "Trainer")


def __getattr__(name: str) -> Any:
    if name in _TRAINER_NAMES:
        from job.train import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'job.train' has no attribute {name!r}")


@storage_scoped
def train(config, *, take_over: bool = False, stop_after_iterations: int | None = None) -> dict:  # a ConfigSchema
    """Train to completion (or for ``stop_after_iterations`` passes, for tests); return a summary.

    ``take_over``: take the checkpoint directory from a run whose heartbeat stopped (job/checkpoint/owner.py)."""
    from job.train.trainer import Trainer  # torch: when training starts

    trainer = Trainer(config, take_over=take_over)
    try:
        return trainer.run(stop_after_iterations=stop_after_iterations)
    finally:
        trainer.close()


__all__ = ["Collaborators", "PassPlan", "Trainer", "train"]
