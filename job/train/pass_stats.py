"""The pass summary line of training_stats.json, built from the pass's bucket records alone.

Single-process and distributed runs write the same shape (the distributed committer has every rank's
bucket records, the single process its own), so readers (report, status, TensorBoard) need not know
how a run was scheduled. Metrics are averaged over edges: a bucket's ``count`` weights its metrics.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

from job.eval_protocol import recorded_label
from job.train.schedule.interfaces import Iteration, PassGather


def weighted(records: Sequence[dict[str, Any]], key: str) -> Optional[dict[str, Any]]:
    """``{"count", "metrics"}`` of the records' ``key`` entries, metrics averaged weighted by count, with the
    entries' ``protocol`` and ``filtered`` when they all agree on them; None when no record has one."""
    entries = [r[key] for r in records if key in r]
    if not entries:
        return None
    count = sum(int(e["count"]) for e in entries)
    sums: dict[str, float] = {}
    for entry in entries:
        for name, value in entry["metrics"].items():
            sums[name] = sums.get(name, 0.0) + value * entry["count"]
    out: dict[str, Any] = {"count": count, "metrics": {name: total / max(count, 1) for name, total in sums.items()}}
    for field in ("protocol", "filtered"):
        values = {e.get(field) for e in entries}
        if len(values) == 1 and None not in values:
            out[field] = values.pop()
    return out


def add_io(own: dict[str, Any], others: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Partition I/O of every rank, added up (seconds rounded as ``IOStats.as_record`` does)."""
    total = dict(own)
    for record in others:
        for name, value in record.items():
            total[name] = total.get(name, 0) + value
    return {name: round(value, 3) if isinstance(value, float) else value for name, value in total.items()}


def pass_summary(iteration: Iteration, gathered: PassGather, wall_seconds: float, io: dict[str, Any],
                 version: int) -> dict[str, Any]:
    """The ``pass_summary`` record of a pass."""
    records = gathered.records
    stats = weighted(records, "stats") or {"count": 0, "metrics": {}}
    compute_seconds = sum(float(r.get("time", 0.0)) for r in records)
    summary: dict[str, Any] = {
        "epoch_idx": iteration.epoch, "edge_path_idx": iteration.edge_path_idx,
        "edge_chunk_idx": iteration.chunk_idx, "index": iteration.index, "pass_summary": True,
        "world_size": gathered.world_size, "restart_count": gathered.restart_count,
        "buckets_trained": len(records), "buckets_redone": gathered.buckets_redone,
        "stats": stats,
        "edges_per_sec": stats["count"] / compute_seconds if compute_seconds > 0 else 0.0,
        "time": wall_seconds, "checkpoint_version": version,
        **io,
    }
    evaluated = weighted(records, "eval_stats_after")
    if evaluated is not None:
        summary["eval_stats_after"] = evaluated
    return summary


def eval_mrr_of(summary: Optional[dict[str, Any]]) -> Optional[float]:
    """The pass's eval MRR (what early stopping compares), None without held-out edges."""
    if summary is None or "eval_stats_after" not in summary:
        return None
    return float(summary["eval_stats_after"]["metrics"]["mrr"])


def pass_message(iteration: Iteration, num_epochs: int, num_edge_paths: int, num_chunks: int,
                 summary: dict[str, Any], buffered: bool) -> str:
    """The log line of a committed pass."""
    stats = summary["stats"]
    message = (f"epoch {iteration.epoch + 1}/{num_epochs} edge path {iteration.edge_path_idx + 1}/"
               f"{num_edge_paths} chunk {iteration.chunk_idx + 1}/{num_chunks}: "
               f"{stats['count']} edges, {summary['edges_per_sec']:.0f} edges/s, "
               f"loss {stats['metrics'].get('loss', 0.0):.4f}")
    if summary["world_size"] > 1:
        message += f" ({summary['world_size']} trainers)"
    evaluated = summary.get("eval_stats_after")
    if evaluated is not None:
        message += (f", eval MRR {evaluated['metrics']['mrr']:.4f} "
                    f"(hits@10 {evaluated['metrics']['hits@10']:.4f}, {recorded_label(evaluated)})")
    if buffered:
        message += (f"; partitions: {summary['partition_loads']} loads (lower bound "
                    f"{summary.get('partition_loads_lower_bound', '-')}), {summary['partition_reads']} read "
                    f"({summary['bytes_read'] / 2**20:.0f} MiB), {summary['partition_writes']} written "
                    f"({summary['bytes_written'] / 2**20:.0f} MiB), blocked on I/O "
                    f"{summary['io_blocked_seconds']:.1f} s + commit {summary['commit_seconds']:.1f} s")
    return message
