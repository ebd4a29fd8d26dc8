"""What a run's input looks like, shared by training, evaluation, report and grow: entity counts, the
bucket grid, edge chunks, the ids an edge file may hold, edges as tensors, and the device.

These read the config and the input files only; evaluation imports them without importing the
trainer (job/train/trainer.py).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

import storage_adapters as storage
from job.config import ConfigSchema
from job.errors import UserError
from job.formats import edges as edge_format
from job.formats import entities as entity_format
from job.types import Bucket


def pick_device(config: ConfigSchema) -> torch.device:
    """The device the config asks for; under torchrun each local rank takes its own GPU."""
    if config.wants_cuda():
        if not torch.cuda.is_available():
            raise UserError(
                f"config asks for a GPU (device={config.device!r}, num_gpus={config.num_gpus}) but CUDA is not available "
                "on this machine; set num_gpus=0 / device=cpu"
            )
        # one process per GPU: under torchrun each local rank takes its own card (several share one when
        # there are more processes than cards, which is slower but correct)
        index = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def read_entity_counts(config: ConfigSchema) -> dict[str, list[int]]:
    """Entity type -> the number of entities in each of its partitions."""
    return {
        entity_type: entity_format.read_entity_counts(config.entity_path, entity_type, entity.num_partitions)
        for entity_type, entity in config.entities.items()
    }


def bucket_grid(config: ConfigSchema) -> tuple[int, int]:
    """Number of lhs and rhs partitions that buckets range over (1 when a side's types are all unpartitioned)."""
    lhs = max(config.entities[r.lhs].num_partitions for r in config.relations)
    rhs = max(config.entities[r.rhs].num_partitions for r in config.relations)
    return lhs, rhs


def count_edge_chunks(config: ConfigSchema) -> int:
    """``num_edge_chunks``, or as many as the largest bucket file needs for ``max_edges_per_chunk``."""
    if config.num_edge_chunks is not None:
        return config.num_edge_chunks
    nparts_lhs, nparts_rhs = bucket_grid(config)
    most = 0
    for edge_path in config.edge_paths:
        for lhs in range(nparts_lhs):
            for rhs in range(nparts_rhs):
                url = edge_format.edges_file(edge_path, lhs, rhs)
                # an edge takes at least 3 bytes, so small files need no opening
                if storage.size(url) // 3 <= config.max_edges_per_chunk:
                    continue
                most = max(most, edge_format.count_edges(url))
    return chunks_for(config, most)


def chunks_for(config: ConfigSchema, largest: int) -> int:
    """``num_edge_chunks``, or as many as a bucket file of ``largest`` edges needs for ``max_edges_per_chunk``."""
    if config.num_edge_chunks is not None:
        return config.num_edge_chunks
    return max(1, math.ceil(largest / config.max_edges_per_chunk))


def edge_limits(config: ConfigSchema, counts: Mapping[str, Sequence[int]], num_dynamic_rels: int,
                bucket: Bucket) -> edge_format.EdgeLimits:
    """The ids a bucket's edge files may hold (relation count, entity counts of its partitions)."""
    num_rel_ids = num_dynamic_rels if config.dynamic_relations else len(config.relations)
    return edge_format.EdgeLimits.for_bucket(config, counts, num_rel_ids, (bucket.lhs, bucket.rhs))


Features = tuple[Tensor, Tensor]  # (offsets of length E + 1, feature ids): PBG's tensor lists


@dataclass
class EdgeTensors:
    """A bucket chunk's edges (int64), shared with Hogwild workers; feature lists for featurized sides."""

    rel: Tensor
    lhs: Tensor
    rhs: Tensor
    lhs_features: Optional[Features] = None
    rhs_features: Optional[Features] = None

    def __len__(self) -> int:
        return int(self.rel.shape[0])

    def share_memory_(self) -> EdgeTensors:
        tensors = [self.rel, self.lhs, self.rhs]
        for features in (self.lhs_features, self.rhs_features):
            if features is not None:
                tensors.extend(features)
        for t in tensors:
            t.share_memory_()
        return self

    def to(self, device: torch.device) -> EdgeTensors:
        # feature lists stay on the CPU, where each batch's lists are cut out (ragged indexing); a
        # featurized batch moves its own lists to the table's device
        return EdgeTensors(self.rel.to(device), self.lhs.to(device), self.rhs.to(device),
                           self.lhs_features, self.rhs_features)


def edge_tensors(arrays: edge_format.EdgeArrays) -> EdgeTensors:
    """Edge arrays as tensors sharing their memory (no copy)."""
    def features(pair: Optional[tuple[Any, Any]]) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        return None if pair is None else (torch.from_numpy(pair[0]), torch.from_numpy(pair[1]))

    return EdgeTensors(torch.from_numpy(arrays.rel), torch.from_numpy(arrays.lhs), torch.from_numpy(arrays.rhs),
                       features(arrays.lhs_features), features(arrays.rhs_features))
