"""Single-machine training: epochs -> edge sets -> edge chunks -> buckets -> Hogwild workers -> batches.

``train(config)`` is what ``biggraph train`` runs. It resumes from the last committed
checkpoint; every edge chunk pass ends with a new committed version (PBG's rhythm),
so a crash loses at most the pass in flight.
"""

from __future__ import annotations

from job.session import storage_scoped
from job.train.loop import Trainer


@storage_scoped
def train(config, *, stop_after_iterations: int | None = None) -> dict:  # config: a ConfigSchema
    """Train to completion (or for ``stop_after_iterations`` passes, for tests); return a summary."""
    trainer = Trainer(config)
    try:
        return trainer.run(stop_after_iterations=stop_after_iterations)
    finally:
        trainer.close()


__all__ = ["Trainer", "train"]
