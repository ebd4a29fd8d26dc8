"""Prometheus Pushgateway pushes at the end of every pass (config ``pushgateway_url``).

Batch jobs have no scrape endpoint, so each trainer PUTs its numbers as gauges to the gateway; a failed
push is a warning, never a training failure. The pushing is ``prometheus_client``'s ``push_to_gateway``
(the text format, the grouping key's escaping, its handlers for auth): an optional dependency, the
``prometheus`` extra, imported when a reporter is built; without it the reporter is not built and the
trainer says so once (``job.monitoring.make_reporter``).
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Optional

from job.monitoring.base import RANKING_METRICS, Reporter, metric

logger = logging.getLogger("biggraph")

PUSH_TIMEOUT_S = 5.0

# name, help; values come from ``PushgatewayReporter._values``
PUSH_METRICS = (
    ("biggraph_pass", "Number of the last pass (epoch x edge path x chunk) this trainer finished."),
    ("biggraph_passes_total", "Number of passes of the whole run."),
    ("biggraph_epoch", "Epoch (1-based) of the last finished pass."),
    ("biggraph_loss", "Mean training loss over the last pass."),
    ("biggraph_edges_per_second", "Training throughput of the last pass (edges per second of compute)."),
    ("biggraph_pass_edges", "Edges trained in the last pass."),
    ("biggraph_edges_trained", "Edges trained by this process since it started."),
    ("biggraph_pass_seconds", "Wall-clock seconds of the last pass (rank 0: including the commit)."),
    ("biggraph_compute_seconds", "Seconds spent training buckets in the last pass, on this trainer."),
    ("biggraph_io_seconds", "Seconds spent loading partitions and reading edges in the last pass, on this trainer."),
    ("biggraph_swap_seconds", "Seconds spent swapping partitions in and out in the last pass, on this trainer."),
    ("biggraph_eval_mrr", "Mean reciprocal rank on the held-out edges after the last pass."),
    ("biggraph_eval_hits_at_1", "Hits@1 on the held-out edges after the last pass."),
    ("biggraph_eval_hits_at_10", "Hits@10 on the held-out edges after the last pass."),
    ("biggraph_eval_hits_at_50", "Hits@50 on the held-out edges after the last pass."),
    ("biggraph_eval_auc", "AUC on the held-out edges after the last pass."),
    ("biggraph_eval_mean_rank", "Mean rank on the held-out edges after the last pass."),
    ("biggraph_last_push_timestamp_seconds", "Unix time of this push."),
)


def exposition(values: dict[str, float]) -> Any:
    """The gauges of ``values`` (the finite ones, in ``PUSH_METRICS`` order) in a registry of their own."""
    from prometheus_client import CollectorRegistry, Gauge  # optional dependency (see the module docstring)

    registry = CollectorRegistry()
    for name, text in PUSH_METRICS:
        if name in values and values[name] is not None and math.isfinite(values[name]):
            Gauge(name, text, registry=registry).set(float(values[name]))
    return registry


class PushgatewayReporter(Reporter):
    """Pushes this trainer's numbers after each pass; other ranks (no pass summary) push when their pass changes."""

    def __init__(self, url: str, job: str, rank: int, total_passes: int, buckets_per_pass: int) -> None:
        import prometheus_client  # noqa: F401  # ImportError now, at start, rather than at the first push

        self.url = url
        self.job = job
        self.rank = rank
        self.total_passes = total_passes
        self.buckets_per_pass = max(1, buckets_per_pass)
        self.buckets: list[dict[str, Any]] = []
        self.current_pass: Optional[int] = None
        self.edges_trained = 0.0
        self.failures = 0

    def _pass_of(self, record: dict[str, Any]) -> int:
        return int(record.get("index", 0)) // self.buckets_per_pass

    def on_bucket(self, record: dict[str, Any]) -> None:
        this_pass = self._pass_of(record)
        if self.current_pass is not None and this_pass != self.current_pass and self.buckets:
            self._push(None)
        self.current_pass = this_pass
        self.buckets.append(record)
        self.edges_trained += metric(record, "stats", "count") or 0.0

    def on_pass(self, summary: dict[str, Any]) -> None:
        self._push(summary)

    def close(self) -> None:
        if self.buckets:
            self._push(None)

    def _values(self, summary: Optional[dict[str, Any]]) -> dict[str, float]:
        buckets = self.buckets
        values: dict[str, float] = {"biggraph_passes_total": self.total_passes,
                                    "biggraph_edges_trained": self.edges_trained,
                                    "biggraph_last_push_timestamp_seconds": time.time()}
        count = sum(metric(r, "stats", "count") or 0.0 for r in buckets)
        compute = sum(metric(r, "time") or 0.0 for r in buckets)
        if buckets:
            values["biggraph_compute_seconds"] = compute
            values["biggraph_io_seconds"] = sum(metric(r, "io_time") or 0.0 for r in buckets)
            values["biggraph_swap_seconds"] = sum(metric(r, "swap_time") or 0.0 for r in buckets)
            values["biggraph_pass_edges"] = count
            if count:
                values["biggraph_loss"] = sum((metric(r, "stats", "metrics", "loss") or 0.0) * (metric(r, "stats", "count")
                                              or 0.0) for r in buckets) / count
            if compute > 0:
                values["biggraph_edges_per_second"] = count / compute
            last = buckets[-1]
            values["biggraph_pass"] = self._pass_of(last) + 1
            values["biggraph_epoch"] = int(last.get("epoch_idx", 0)) + 1
        eval_sums: dict[str, float] = {}
        eval_count = 0.0
        for r in buckets:
            n = metric(r, "eval_stats_after", "count") or 0.0
            metrics = (r.get("eval_stats_after") or {}).get("metrics") or {}
            for name in RANKING_METRICS:
                if isinstance(metrics.get(name), (int, float)):
                    eval_sums[name] = eval_sums.get(name, 0.0) + float(metrics[name]) * n
            eval_count += n
        evals = {k: v / eval_count for k, v in eval_sums.items()} if eval_count else {}
        if summary is not None:
            values["biggraph_pass"] = int(summary.get("index", 0)) + 1
            values["biggraph_epoch"] = int(summary.get("epoch_idx", 0)) + 1
            for name, path in (("biggraph_loss", ("stats", "metrics", "loss")), ("biggraph_pass_edges", ("stats", "count")),
                               ("biggraph_edges_per_second", ("edges_per_sec",)), ("biggraph_pass_seconds", ("time",))):
                value = metric(summary, *path)
                if value is not None:
                    values[name] = value
            for name in RANKING_METRICS:
                value = metric(summary, "eval_stats_after", "metrics", name)
                if value is not None:
                    evals[name] = value
        for name, value in evals.items():
            values["biggraph_eval_" + name.replace("@", "_at_")] = value
        return values

    def _push(self, summary: Optional[dict[str, Any]]) -> None:
        from prometheus_client import push_to_gateway

        registry = exposition(self._values(summary))
        self.buckets = []
        try:  # PUT: replaces what the group {job, instance} held
            push_to_gateway(self.url, job=self.job, registry=registry, grouping_key={"instance": str(self.rank)},
                            timeout=PUSH_TIMEOUT_S)
        except Exception as err:  # a monitoring outage must not stop training
            self.failures += 1
            logger.warning("pushgateway %s: push failed (%s); training goes on", self.url, err)
