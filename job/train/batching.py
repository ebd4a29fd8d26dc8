"""From a bucket's edges to batches, as PBG's batch preparation describes.

Without dynamic relations a batch holds a single relation type: the worker samples a
relation with probability proportional to its edges left, then takes the next
``batch_size`` edges of that type. With dynamic relations batches are contiguous.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from job.train.step import BatchContext, BatchStats, run_batch


@dataclass
class EdgeTensors:
    """A bucket chunk's edges (int64), shared with Hogwild workers."""

    rel: Tensor
    lhs: Tensor
    rhs: Tensor

    def __len__(self) -> int:
        return int(self.rel.shape[0])

    def share_memory_(self) -> EdgeTensors:
        for t in (self.rel, self.lhs, self.rhs):
            t.share_memory_()
        return self


def process_edges(
    ctx: BatchContext,
    edges: EdgeTensors,
    indices: Tensor,
    batch_size: int,
    dynamic: bool,
    generator: torch.Generator,
    train: bool,
) -> BatchStats:
    """Run every batch of the edges selected by ``indices`` (already shuffled)."""
    total = BatchStats()
    if indices.numel() == 0:
        return total
    rel = edges.rel[indices]
    lhs = edges.lhs[indices]
    rhs = edges.rhs[indices]
    if dynamic:
        for start in range(0, rel.shape[0], batch_size):
            end = start + batch_size
            total.add(run_batch(ctx, 0, lhs[start:end], rhs[start:end], rel[start:end], generator, train))
        return total
    # group by relation, keeping the shuffled order within each group
    order = torch.argsort(rel, stable=True)
    sorted_rel = rel[order]
    rel_values, counts = torch.unique_consecutive(sorted_rel, return_counts=True)
    offsets = torch.cumsum(counts, 0) - counts
    lhs_sorted = lhs[order]
    rhs_sorted = rhs[order]
    left = counts.clone()
    while True:
        remaining = int(left.sum())
        if remaining == 0:
            break
        if len(left) == 1:
            group = 0
        else:
            group = int(torch.multinomial(left.double(), 1, generator=generator))
        taken = int(counts[group] - left[group])
        size = min(batch_size, int(left[group]))
        start = int(offsets[group]) + taken
        total.add(run_batch(ctx, int(rel_values[group]), lhs_sorted[start:start + size], rhs_sorted[start:start + size],
                            None, generator, train))
        left[group] -= size
    return total
