"""Where a pass's edges come from: a collaborator the trainer is given, not a method a subclass overrides.

``ChunkedEdges`` reads edge chunk ``chunk_idx`` of a bucket's file (PBG's ``num_edge_chunks``), which is every
ordinary run. ``biggraph grow`` passes its own source (job/growing/training.py: the grown edges plus a replayed
sample of the old ones). Every source checks the ids it read against the bucket's limits before any update (an id
beyond its partition would index another row, or wrap around).
"""

from __future__ import annotations

from typing import Protocol

from job.formats import edges as edge_format
from job.train.inputs import EdgeTensors, edge_tensors
from job.train.schedule.interfaces import Iteration
from job.types import Bucket


class EdgeSource(Protocol):
    def read(self, iteration: Iteration, edge_path: str, bucket: Bucket, num_chunks: int,
             limits: edge_format.EdgeLimits) -> EdgeTensors:
        """The edges ``bucket`` trains on in the pass ``iteration`` (of ``num_chunks`` chunks per edge set), checked
        against ``limits``."""
        ...


class ChunkedEdges:
    """Chunk ``iteration.chunk_idx`` of the bucket's edge file."""

    def read(self, iteration: Iteration, edge_path: str, bucket: Bucket, num_chunks: int,
             limits: edge_format.EdgeLimits) -> EdgeTensors:
        url = edge_format.edges_file(edge_path, bucket.lhs, bucket.rhs)
        with edge_format.open_h5(url) as handle:
            num_edges = edge_format.check_edge_file(handle, url)
            begin, end = edge_format.chunk_bounds(num_edges, iteration.chunk_idx, num_chunks)
            arrays = edge_format.read_edges_from_handle(handle, url, begin, end)
        limits.check(arrays, url, begin)
        return edge_tensors(arrays)
