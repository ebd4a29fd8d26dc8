"""Training after a grow: the new edges, plus a replayed sample of the old ones, from the same edge files.

After a grow each bucket file holds the old edges followed by the new ones, and the journal records
where the new ones start (``GrowRecord.boundaries``). A pass reads the tail whole and a fresh uniform
``grow_replay_fraction`` sample of the head, seeded by pass and bucket, so nothing is copied: the
edges the model already fit keep pulling the old rows into place while the new rows find theirs.

Everything else is the ordinary ``Trainer``: partitions, Hogwild workers, frozen types, commits.
The passes continue the checkpoint's versions: pass i commits version ``record.version + i + 1``,
so a killed run resumes at the first pass not committed.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from job.checkpoint.journal import GrowRecord
from job.config import ConfigSchema
from job.formats import edges as edge_format
from job.monitoring import make_reporter
from job.train.batching import EdgeTensors
from job.train.buckets import Bucket
from job.train.data import edge_limits, edge_tensors
from job.train.loop import Iteration, Trainer

_READ_CHUNK = 1 << 20  # old edges read at a time while sampling them


def total_passes(config: ConfigSchema, num_chunks: int) -> int:
    return config.grow_num_epochs * len(config.edge_paths) * num_chunks


class GrowTrainer(Trainer):
    """``Trainer`` whose passes read the grow's new edges plus a replay sample (see the module docstring)."""

    def __init__(self, config: ConfigSchema, record: GrowRecord) -> None:
        self.user_config = config
        # no epoch snapshots: their epoch_{E}/ names would be those of the base run's snapshots; no Hogwild start
        # delay: it lets the first worker move freshly initialised rows alone, and these rows are trained
        super().__init__(dataclasses.replace(config, num_epochs=max(1, config.grow_num_epochs),
                                             checkpoint_preservation_interval=None, hogwild_delay=0.0))
        self.record = record
        self.first_index = record.version
        self.iterations = [Iteration(record.version + it.index, it.epoch, it.edge_path_idx, it.chunk_idx)
                           for it in self.iterations]
        self._pass_index = record.version
        self._edge_path_idx = 0
        # progress counts passes by checkpoint version, as on any resume: these passes follow the grown version
        self.reporter.close()
        self.reporter = make_reporter(self.config, rank=self.rank, total_passes=record.version + len(self.iterations),
                                      buckets_per_pass=self.nparts_lhs * self.nparts_rhs)

    def run(self, stop_after_iterations: int | None = None) -> dict:
        try:
            return super().run(stop_after_iterations)
        finally:
            # config.json describes the model, whose training config is the user's, not these passes'
            self.checkpoint.save_config(self.user_config.to_pbg_json())

    def _run_pass(self, iteration: Iteration) -> dict[str, Any]:
        self._pass_index = iteration.index
        self._edge_path_idx = iteration.edge_path_idx
        return super()._run_pass(iteration)

    def _read_bucket_chunk(self, edge_path: str, bucket: Bucket, chunk_idx: int) -> EdgeTensors:
        url = edge_format.edges_file(edge_path, bucket.lhs, bucket.rhs)
        boundaries = self.record.boundaries[self._edge_path_idx]
        fraction = self.config.grow_replay_fraction
        with edge_format.open_h5(url) as handle:
            num_edges = edge_format.check_edge_file(handle, url)
            boundary = min(boundaries[bucket.lhs * self.nparts_rhs + bucket.rhs], num_edges)
            begin, end = edge_format.chunk_bounds(num_edges - boundary, chunk_idx, self.num_chunks)
            parts = [edge_format.read_edges_from_handle(handle, url, boundary + begin, boundary + end)]
            old_begin, old_end = edge_format.chunk_bounds(boundary, chunk_idx, self.num_chunks)
            if fraction > 0 and old_end > old_begin:
                seed = [self.config.seed or 0, self._pass_index, bucket.lhs, bucket.rhs, chunk_idx]
                rng = np.random.default_rng(np.random.SeedSequence(seed))
                for first in range(old_begin, old_end, _READ_CHUNK):
                    block = edge_format.read_edges_from_handle(handle, url, first, min(old_end, first + _READ_CHUNK))
                    keep = rng.random(len(block)) < fraction if fraction < 1 else slice(None)
                    parts.append(edge_format.EdgeArrays(block.rel[keep], block.lhs[keep], block.rhs[keep]))
        arrays = edge_format.EdgeArrays(np.concatenate([p.rel for p in parts]), np.concatenate([p.lhs for p in parts]),
                                        np.concatenate([p.rhs for p in parts]))
        edge_limits(self.config, self.entity_counts, self.num_dynamic_rels, bucket).check(arrays, url, 0)
        return edge_tensors(arrays)
