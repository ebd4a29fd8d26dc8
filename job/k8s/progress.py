"""A running job's training progress, read from its checkpoint (``training_stats.json``).

``biggraph status`` calls this with the config in the job's ConfigMap, so the checkpoint is read
with that config's own ``storage_options`` (the endpoint and credentials the pods use).
"""

from __future__ import annotations

from typing import Any

import storage_adapters as storage
from job.formats.checkpoint import CheckpointStorage
from job.session import storage_scoped


@storage_scoped
def training_progress(config: dict[str, Any]) -> dict[str, Any]:
    """Committed version and each worker's last bucket, from ``training_stats.json`` under checkpoint_path.

    A best effort: ``{"available": False, "reason": ...}`` when there is no checkpoint to read, so that
    ``status`` still reports the job itself.
    """
    url = config.get("checkpoint_path")
    if not url:
        return {"available": False, "reason": "the config has no checkpoint_path"}
    try:
        checkpoint = CheckpointStorage(url)
        version = checkpoint.load_version()
        stats = checkpoint.load_stats() if storage.exists(checkpoint.stats_file()) else []
    except Exception as err:  # any backend failure: progress is a best effort
        return {"available": False, "checkpoint_path": url, "reason": f"{type(err).__name__}: {str(err).splitlines()[0]}"}
    workers: dict[str, dict[str, Any]] = {}
    last_pass = None
    for record in stats:
        if record.get("pass_summary"):
            last_pass = record
        elif "lhs_partition" in record:
            workers[str(record.get("rank", 0))] = _worker_position(record)
    result: dict[str, Any] = {"available": True, "checkpoint_path": url, "version": version,
                              "num_epochs": config.get("num_epochs", 1), "workers": workers}
    if last_pass is not None:
        result["last_pass"] = {"epoch": last_pass.get("epoch_idx", 0) + 1,
                               "loss": (last_pass.get("stats") or {}).get("metrics", {}).get("loss")}
    return result


def _worker_position(record: dict[str, Any]) -> dict[str, Any]:
    """Where one bucket's stats record puts its worker (epochs counted from 1)."""
    return {"epoch": record.get("epoch_idx", 0) + 1, "edge_path": record.get("edge_path_idx", 0),
            "chunk": record.get("edge_chunk_idx", 0),
            "bucket": [record.get("lhs_partition"), record.get("rhs_partition")],
            "edges_per_sec": round(float(record.get("edges_per_sec") or 0.0), 1)}
