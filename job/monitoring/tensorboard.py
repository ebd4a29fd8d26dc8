"""TensorBoard scalars per bucket and per pass (config ``tensorboard_dir``; ``pip install 'biggraph[tensorboard]'``).

torch's SummaryWriter is imported when the reporter is made: it needs the optional tensorboard package,
whose absence ``make_reporter`` turns into a warning.
"""

from __future__ import annotations

import os
from typing import Any

from job.monitoring.base import RANKING_METRICS, Reporter, metric


def scalars_of_bucket(record: dict[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    for tag, path in (("bucket/loss", ("stats", "metrics", "loss")), ("bucket/edges_per_sec", ("edges_per_sec",)),
                      ("bucket/compute_time_s", ("time",)), ("bucket/io_time_s", ("io_time",)),
                      ("bucket/swap_time_s", ("swap_time",))):
        value = metric(record, *path)
        if value is not None:
            out[tag] = value
    for name in RANKING_METRICS:
        for when in ("before", "after"):
            value = metric(record, f"eval_stats_{when}", "metrics", name)
            if value is not None:
                out[f"bucket_eval_{when}/{name}"] = value
    return out


def scalars_of_pass(summary: dict[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    for tag, path in (("pass/loss", ("stats", "metrics", "loss")), ("pass/edges_per_sec", ("edges_per_sec",)),
                      ("pass/time_s", ("time",)), ("pass/edges", ("stats", "count"))):
        value = metric(summary, *path)
        if value is not None:
            out[tag] = value
    for name in RANKING_METRICS:
        value = metric(summary, "eval_stats_after", "metrics", name)
        if value is not None:
            out[f"eval/{name}"] = value
    return out


class TensorBoardReporter(Reporter):
    """Scalars per bucket (step: global bucket index) and per pass (step: pass number)."""

    def __init__(self, log_dir: str, rank: int = 0) -> None:
        from torch.utils.tensorboard import SummaryWriter  # optional: needs the tensorboard package

        world = int(os.environ.get("WORLD_SIZE", "1") or 1)
        self.log_dir = os.path.join(log_dir, f"rank{rank}") if world > 1 else log_dir
        self.writer = SummaryWriter(log_dir=self.log_dir)

    def on_bucket(self, record: dict[str, Any]) -> None:
        step = int(record.get("index", 0))
        for tag, value in scalars_of_bucket(record).items():
            self.writer.add_scalar(tag, value, step)

    def on_pass(self, summary: dict[str, Any]) -> None:
        step = int(summary.get("index", 0)) + 1
        for tag, value in scalars_of_pass(summary).items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
