"""What a checkpoint's validation lines say: the best version so far, and whether early stopping has ended the run.

The validation lines (``validation_edge_paths``; job/train/validation.py writes them into training_stats.json) are
the checkpoint's own record of how training went, so two readers decide from them alike: the trainer when it opens
the checkpoint (a run that early stopping ended is complete, and a restarted pod or a resubmitted Job must not train
past it), and ``biggraph completed`` (the pod entrypoint's question). Torch-free, for the latter.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any, Optional

from job.config import ConfigSchema


def is_validation(record: dict[str, Any]) -> bool:
    """Whether a training_stats.json line is a validation line (not a bucket record or a pass summary)."""
    return bool(record.get("validation"))


@dataclasses.dataclass
class Patience:
    """The best validation MRR so far and how many validations in a row have not beaten it."""

    best_mrr: Optional[float] = None
    best_version: Optional[int] = None
    stale: int = 0
    last_version: Optional[int] = None  # the version the last validation line scored

    def improves(self, mrr: float) -> bool:
        return self.best_mrr is None or mrr > self.best_mrr

    def observe(self, record: dict[str, Any]) -> None:
        mrr = float(record["metrics"]["mrr"])
        self.last_version = int(record["checkpoint_version"])
        if self.improves(mrr):
            self.best_mrr, self.best_version, self.stale = mrr, self.last_version, 0
        else:
            self.stale += 1

    def exhausted(self, config: ConfigSchema) -> bool:
        """Whether early stopping ends training after the validations observed so far."""
        return bool(config.early_stopping and config.validation_edge_paths
                    and self.stale >= config.early_stopping_patience)


def history(records: Iterable[dict[str, Any]], up_to_version: Optional[int] = None) -> Patience:
    """The patience after the validation lines of ``records`` (those of versions up to ``up_to_version``: lines a
    killed run wrote past its committed version do not count)."""
    patience = Patience()
    for record in records:
        if is_validation(record) and (up_to_version is None or int(record["checkpoint_version"]) <= up_to_version):
            patience.observe(record)
    return patience


def stopped_early_at(config: ConfigSchema, records: Iterable[dict[str, Any]], version: int) -> Optional[Patience]:
    """The patience when early stopping ended training at the committed ``version`` (its last validation line
    scored ``version`` and left no patience); None when training goes on."""
    patience = history(records, version)
    return patience if patience.exhausted(config) and patience.last_version == version else None
