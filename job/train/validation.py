"""Validation during training (``validation_edge_paths``): score the version just committed, keep the best one, and
tell early stopping when to stop.

The committing process (rank 0, or the single process) reads the version it has just committed back through
``CheckpointManager.reader`` (``job.evaluation.evaluate``: what is scored is exactly what was committed), ranks the
validation edges (all candidates, filtered by the training, validation and ``validation_filter_paths`` edges, unless
``validation_filtered`` is false), appends one line to training_stats.json and, when the version beats the best one,
makes it the best (``CheckpointManager.keep_best``: ``best_version.txt``, the previous best's files dropped). The
line reaches every process of a torchrun group through ``BucketScheduler.publish``; each one then updates the same
:class:`Patience`, so all stop together.

A validation line::

    {"validation": true, "epoch_idx": 2, "checkpoint_version": 3, "seconds": 41.2, "count": 3034,
     "metrics": {"mrr": ..., "hits@1": ..., "hits@10": ..., ...}, "protocol": "all", "filtered": true,
     "label": "all candidates, filtered", "best_version": 3, "best_mrr": ..., "improved": true}

``seconds``: wall time since training started (a resumed run goes on from its last validation line's).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Optional

from job.checkpoint import CheckpointManager
from job.checkpoint.validation_history import Patience, history, is_validation, stopped_early_at
from job.config import ConfigSchema
from job.eval_protocol import protocol_label

logger = logging.getLogger("biggraph")


class Validation:
    """One run's validations; ``enabled`` is False without ``validation_edge_paths`` (then it does nothing)."""

    def __init__(self, config: ConfigSchema, checkpoints: CheckpointManager) -> None:
        self.config = config
        self.checkpoints = checkpoints
        self.enabled = bool(config.validation_edge_paths)
        self.patience = Patience()
        self.offset = 0.0  # seconds of training before this run (a resumed run's earlier validations)
        # every validation line so far, the earlier runs' and this one's as published to every process: what the
        # plateau schedule reads (job/train/lr_schedule.py)
        self.lines: list[dict[str, Any]] = []
        self.started = time.perf_counter()
        if not self.enabled:
            return
        self.filter_paths = (list(config.edge_paths) + list(config.validation_edge_paths)
                             + list(config.validation_filter_paths)) if config.validation_filtered else []
        # what `biggraph eval` would be given: the validation edges as the edges to rank
        self.eval_config = dataclasses.replace(config, edge_paths=list(config.validation_edge_paths))
        records = checkpoints.storage.load_stats()  # a resumed run goes on with its earlier validations
        self.patience = history(records)
        self.offset = max((float(r.get("seconds") or 0.0) for r in records if is_validation(r)), default=0.0)
        self.records = records
        self.lines = [r for r in records if is_validation(r)]

    def start(self) -> None:
        """Training starts now (``seconds`` of the lines count from here, after a resumed run's earlier ones)."""
        self.started = time.perf_counter()

    def due(self, epoch: int, ends_epoch: bool) -> bool:
        """Whether the pass that ends ``epoch`` (0-based) is validated: every validation_interval epochs, and the
        last epoch."""
        if not self.enabled or not ends_epoch:
            return False
        return (epoch + 1) % self.config.validation_interval == 0 or epoch + 1 == self.config.num_epochs

    def score(self, epoch: int, version: int) -> dict[str, Any]:
        """Rank the validation edges with the committed ``version``, record the line, keep the version when it is
        the best so far; returns the line (the committing process only)."""
        from job.evaluation import evaluate  # torch-heavy, and it imports the trainer's modules

        metrics = evaluate(self.eval_config, filter_paths=self.filter_paths,
                           candidates="all" if self.filter_paths else None, version=version)
        mrr = float(metrics["mrr"])
        improved = self.patience.improves(mrr)
        best_version = version if improved else self.patience.best_version
        best_mrr = mrr if improved else self.patience.best_mrr
        record: dict[str, Any] = {
            "validation": True, "epoch_idx": epoch, "checkpoint_version": version,
            "seconds": round(self.offset + time.perf_counter() - self.started, 3), "count": metrics["count"],
            "metrics": {k: v for k, v in metrics.items() if k not in ("protocol", "filtered", "count", "seconds",
                                                                        "num_ranks")},
            "protocol": metrics["protocol"], "filtered": metrics["filtered"],
            "label": protocol_label(metrics["protocol"], metrics["filtered"]),
            "best_version": best_version, "best_mrr": best_mrr, "improved": improved,
            "eval_seconds": metrics["seconds"],
        }
        self.checkpoints.record([record])
        if improved:
            self.checkpoints.keep_best(version)
        logger.info("validation after epoch %d (version %d, %s): MRR %.4f, Hits@1 %.4f, Hits@10 %.4f on %d edges; "
                    "best: version %d (MRR %.4f)", epoch + 1, version, record["label"], mrr,
                    record["metrics"].get("hits@1", 0.0), record["metrics"].get("hits@10", 0.0), record["count"],
                    best_version, best_mrr, extra={"fields": record})
        return record

    def ended(self, version: int) -> Optional[str]:
        """Why training is already over at the committed ``version`` because early stopping ended it (then a
        restarted pod or a resubmitted Job trains nothing more); None when it goes on."""
        if not self.enabled or (patience := stopped_early_at(self.config, self.records, version)) is None:
            return None
        return (f"training already complete: early stopping ended it at checkpoint version {version} (no validation "
                f"MRR above {patience.best_mrr:.4f}, version {patience.best_version}, for {patience.stale} "
                f"validation(s); early_stopping_patience {self.config.early_stopping_patience})")

    def stops(self, record: dict[str, Any]) -> bool:
        """Every process, with the published line: whether early stopping ends training here."""
        self.patience.observe(record)
        self.lines.append(record)
        if not self.config.early_stopping:
            return False
        logger.info("early stopping check after the validation of version %d: MRR %.6f, best %.6f (version %d), %d "
                    "validation(s) without improvement", record["checkpoint_version"], record["metrics"]["mrr"],
                    self.patience.best_mrr, self.patience.best_version, self.patience.stale)
        if not self.patience.exhausted(self.config):
            return False
        logger.info("early stopping: the validation MRR has not beaten %.4f (version %d) for %d validation(s) "
                    "(early_stopping_patience %d)", self.patience.best_mrr, self.patience.best_version,
                    self.patience.stale, self.config.early_stopping_patience)
        return True

    def summary(self) -> Optional[str]:
        """The line that says which version is best and how to read it (None without validations)."""
        if self.patience.best_version is None:
            return None
        return (f"best validation MRR {self.patience.best_mrr:.4f}: checkpoint version {self.patience.best_version}, "
                f"kept in {self.config.checkpoint_path} (best_version.txt); read it with `biggraph eval CONFIG "
                f"--version best` (or `biggraph export ... --version best`)")
