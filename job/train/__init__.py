"""Single-machine training: epochs -> edge sets -> edge chunks -> buckets -> Hogwild workers -> batches.

``train(config)`` is what ``biggraph train`` runs. It resumes from the last committed
checkpoint; every edge chunk pass ends with a new committed version (PBG's rhythm),
so a crash loses at most the pass in flight.
"""

from __future__ import annotations

import os

from job.growing.journal import finish_committed_grow
from job.growing.journal_checks import GrowInputs
from job.session import storage_scoped
from job.train.loop import Trainer


@storage_scoped
def train(config, *, stop_after_iterations: int | None = None) -> dict:  # config: a ConfigSchema
    """Train to completion (or for ``stop_after_iterations`` passes, for tests); return a summary."""
    # a committed grow's unpublished input is finished, an uncommitted one's removed, with its journal held to
    # this config's entity_path / edge_paths (Trainer repeats the call without them: by then it has nothing to do)
    finish_committed_grow(config.checkpoint_path, clean_uncommitted=os.environ.get("RANK", "0") == "0",
                          inputs=GrowInputs.of(config))
    trainer = Trainer(config)
    try:
        return trainer.run(stop_after_iterations=stop_after_iterations)
    finally:
        trainer.close()


__all__ = ["Trainer", "train"]
