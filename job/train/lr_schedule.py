"""The learning-rate schedule (``lr_decay``, ``lr_plateau_factor``): the factor by which a pass multiplies ``lr`` and
``relation_lr``.

The factor keeps no state of its own. It is a function of two things the checkpoint already records: the pass's
epoch number (which follows from the committed version: ``PassPlan``) and the validation lines of
training_stats.json (``validation_edge_paths``, job/train/validation.py). So:

- a resumed run (a restarted pod, ``biggraph train`` on an existing checkpoint, a resubmitted Job) goes on at the
  rate the interrupted one would have used for the same pass, with nothing extra saved and nothing to lose;
- every trainer of a torchrun group runs the same pass and receives the same validation line with the pass result
  (``BucketScheduler.publish``), so all of them use the same rate without exchanging it;
- Hogwild workers are handed the factor with each bucket (``WorkerPool.run``): they took the config when they
  started, and a rate read from it would never decay.

The optimizers' saved state keeps the configured (undecayed) ``lr`` in its ``param_groups``, as PBG writes it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional

from job.checkpoint.validation_history import is_validation
from job.config import ConfigSchema


def plateau_reductions(records: Iterable[dict[str, Any]], patience: int, up_to_version: Optional[int] = None) -> int:
    """How many times the rate has been reduced after the validation lines of ``records`` (those of versions up to
    ``up_to_version``; lines a killed run wrote past its committed version do not count).

    As torch's ``ReduceLROnPlateau`` (mode max, threshold 0, no cooldown): a validation MRR above the best so far
    resets the count of validations without improvement; once it reaches ``patience`` the rate is reduced and the
    count starts again."""
    best: Optional[float] = None
    stale = 0
    reductions = 0
    for record in records:
        if not is_validation(record):
            continue
        if up_to_version is not None and int(record["checkpoint_version"]) > up_to_version:
            continue
        mrr = float(record["metrics"]["mrr"])
        if best is None or mrr > best:
            best, stale = mrr, 0
            continue
        stale += 1
        if stale >= patience:
            reductions += 1
            stale = 0
    return reductions


def lr_scale(config: ConfigSchema, epoch: int, records: Iterable[dict[str, Any]] = (),
             up_to_version: Optional[int] = None) -> float:
    """The factor on ``lr`` and ``relation_lr`` for a pass of ``epoch`` (0-based) that follows the committed
    ``up_to_version``: ``lr_decay ** epoch`` times ``lr_plateau_factor`` per plateau in the validation ``records``.
    Exactly 1.0 with both options off (PBG's constant rate, bit for bit)."""
    scale = 1.0
    if config.lr_decay != 1.0:
        scale *= float(config.lr_decay) ** epoch
    if config.lr_plateau_factor != 1.0:
        scale *= float(config.lr_plateau_factor) ** plateau_reductions(records, config.lr_plateau_patience,
                                                                      up_to_version)
    return scale
