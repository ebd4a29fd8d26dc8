"""Single-machine training: epochs -> edge sets -> edge chunks -> buckets -> Hogwild workers -> batches.

``train(config)`` is what ``biggraph train`` runs. It resumes from the last committed
checkpoint; every edge chunk pass ends with a new committed version (PBG's rhythm),
so a crash loses at most the pass in flight.
"""

from __future__ import annotations

from job.session import storage_scoped
from job.train.loop import Collaborators, PassPlan, Trainer


@storage_scoped
def train(config, *, take_over: bool = False, stop_after_iterations: int | None = None) -> dict:  # a ConfigSchema
    """Train to completion (or for ``stop_after_iterations`` passes, for tests); return a summary.

    ``take_over``: take the checkpoint directory from a run whose heartbeat stopped (job/checkpoint/owner.py)."""
    trainer = Trainer(config, take_over=take_over)
    try:
        return trainer.run(stop_after_iterations=stop_after_iterations)
    finally:
        trainer.close()


__all__ = ["Collaborators", "PassPlan", "Trainer", "train"]
