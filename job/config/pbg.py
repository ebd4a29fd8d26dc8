"""What PBG 1.0.0 can read: the checkpoint's ``config.json`` less the keys it does not know.

PBG's ``ConfigSchema.from_dict`` rejects unknown keys, so our additions and keys of later
PBG versions are dropped from ``config.json`` (and kept elsewhere by the checkpoint writer).
"""

from __future__ import annotations

from typing import Any

from job.config.choices import BucketOrder

# Keys of ours (or of PBG versions after 1.0.0) that PBG 1.0.0's from_dict refuses.
NON_PBG_1_0_KEYS = frozenset({
    "regularization_coef", "regularizer", "early_stopping", "num_gpus", "num_groups_for_partition_server",
    "num_groups_per_sharded_partition_server", "partition_shard_size", "half_precision", "compute_dtype",
    "seed", "device", "cuda_graphs", "prefetch_partitions", "partition_handoff", "write_behind_buckets",
    "write_behind_seconds", "shared_shards", "partition_buffer", "memory_budget",
    "edge_read_mode", "storage_options",
    "eval_protocol",
    "tensorboard_dir", "pushgateway_url", "pushgateway_job", "grow_init", "grow_num_epochs", "grow_replay_fraction",
    "reciprocal_relations", "embedding_dropout", "init_method", "preset", "hogwild_delay_scope", "entity_optimizer",
    "early_stopping_patience", "validation_edge_paths", "validation_interval", "validation_filtered",
    "validation_filter_paths",
    "lr_decay", "lr_plateau_factor", "lr_plateau_patience", "label_smoothing",
})
NON_PBG_1_0_ENTITY_KEYS = frozenset({"dimension", "frozen"})


def to_pbg_dict(plain: dict[str, Any]) -> dict[str, Any]:
    """A config's plain dict (``ConfigSchema.to_dict()``) without the keys PBG 1.0.0 refuses."""
    out = {k: v for k, v in plain.items() if k not in NON_PBG_1_0_KEYS}
    out["entities"] = {
        name: {k: v for k, v in entity.items() if k not in NON_PBG_1_0_ENTITY_KEYS}
        for name, entity in plain["entities"].items()
    }
    if out.get("bucket_order") == BucketOrder.BUFFER.value:
        out["bucket_order"] = BucketOrder.INSIDE_OUT.value  # PBG 1.0.0 knows only its own four orders
    return out
