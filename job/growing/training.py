"""Training after a grow: the new edges, plus a replayed sample of the old ones, from the same edge files.

After a grow each bucket file holds the old edges followed by the new ones, and the journal records
where the new ones start (``GrowRecord.boundaries``). A pass reads the tail whole and a fresh uniform
``grow_replay_fraction`` sample of the head, seeded by pass and bucket, so nothing is copied: the
edges the model already fit keep pulling the old rows into place while the new rows find theirs.

Everything else is the ordinary ``Trainer``, given this module's collaborators (it subclasses nothing): the edge
source (``GrowEdges``) and the pass plan. The passes continue the checkpoint's versions: pass i commits version
``record.version + i + 1``, so a killed run resumes at the first pass not committed.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from job.checkpoint.journal import GrowRecord
from job.config import ConfigSchema
from job.formats import edges as edge_format
from job.train.inputs import EdgeTensors, bucket_grid, edge_tensors
from job.train.trainer import Collaborators, Iteration, PassPlan, Trainer
from job.types import Bucket

_READ_CHUNK = 1 << 20  # old edges read at a time while sampling them


def grow_trainer(config: ConfigSchema, record: GrowRecord) -> Trainer:
    """The trainer of the passes after a grow: ``grow_num_epochs`` of them over the new edges plus a replay sample,
    numbered after the grown version. No epoch snapshots (their ``epoch_{E}/`` names would be those of the base run's
    snapshots); no Hogwild start delay (it lets the first worker move freshly initialised rows alone, and these rows
    are trained); ``config.json`` keeps describing the user's config, not these passes'."""
    passes = dataclasses.replace(config, num_epochs=max(1, config.grow_num_epochs),
                                 checkpoint_preservation_interval=None, hogwild_delay=0.0)
    return Trainer(passes, parts=Collaborators(edge_source=GrowEdges(record, config), plan=PassPlan(record.version),
                                               described_config=config))


class GrowEdges:
    """A bucket's new edges whole, plus a fresh ``grow_replay_fraction`` sample of its old ones (an ``EdgeSource``)."""

    def __init__(self, record: GrowRecord, config: ConfigSchema) -> None:
        self.record = record
        self.config = config
        self.nparts_rhs = bucket_grid(config)[1]  # boundaries are per bucket, lhs-major

    def read(self, iteration: Iteration, edge_path: str, bucket: Bucket, num_chunks: int,
             limits: edge_format.EdgeLimits) -> EdgeTensors:
        url = edge_format.edges_file(edge_path, bucket.lhs, bucket.rhs)
        boundaries = self.record.boundaries[iteration.edge_path_idx]
        fraction = self.config.grow_replay_fraction
        with edge_format.open_h5(url) as handle:
            num_edges = edge_format.check_edge_file(handle, url)
            boundary = min(boundaries[bucket.lhs * self.nparts_rhs + bucket.rhs], num_edges)
            begin, end = edge_format.chunk_bounds(num_edges - boundary, iteration.chunk_idx, num_chunks)
            parts = [edge_format.read_edges_from_handle(handle, url, boundary + begin, boundary + end)]
            old_begin, old_end = edge_format.chunk_bounds(boundary, iteration.chunk_idx, num_chunks)
            if fraction > 0 and old_end > old_begin:
                seed = [self.config.seed or 0, iteration.index, bucket.lhs, bucket.rhs, iteration.chunk_idx]
                rng = np.random.default_rng(np.random.SeedSequence(seed))
                for first in range(old_begin, old_end, _READ_CHUNK):
                    block = edge_format.read_edges_from_handle(handle, url, first, min(old_end, first + _READ_CHUNK))
                    keep = rng.random(len(block)) < fraction if fraction < 1 else slice(None)
                    parts.append(edge_format.EdgeArrays(block.rel[keep], block.lhs[keep], block.rhs[keep]))
        arrays = edge_format.EdgeArrays(np.concatenate([p.rel for p in parts]), np.concatenate([p.lhs for p in parts]),
                                        np.concatenate([p.rhs for p in parts]))
        limits.check(arrays, url, 0)
        return edge_tensors(arrays)
