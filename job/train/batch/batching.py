"""From a bucket's edges to batches, as PBG's batch preparation describes.

Without dynamic relations a batch holds a single relation type: the worker samples a
relation with probability proportional to its edges left, then takes the next
``batch_size`` edges of that type. With dynamic relations batches are contiguous.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from job.train.batch.graphs import GraphedSteps
from job.train.batch.step import BatchContext, BatchStats, BucketAbandoned, run_batch
from job.train.inputs import EdgeTensors, Features


def select_features(features: Optional[Features], indices: Tensor) -> Optional[Features]:
    """The feature lists of the edges ``indices``, in that order (vectorised ragged gather)."""
    if features is None:
        return None
    offsets, data = features
    lengths = offsets[1:] - offsets[:-1]
    picked = lengths[indices]
    new_offsets = torch.zeros(indices.numel() + 1, dtype=torch.long)
    torch.cumsum(picked, 0, out=new_offsets[1:])
    total = int(new_offsets[-1])
    if total == 0:
        return new_offsets, data[:0]
    starts = torch.repeat_interleave(offsets[:-1][indices], picked)
    within = torch.arange(total) - torch.repeat_interleave(new_offsets[:-1], picked)
    return new_offsets, data[starts + within]


def split_almost_equally(size: int, parts: int) -> list[slice]:
    """Exactly ``parts`` consecutive slices of ``range(size)``, their sizes the floor or the ceil of
    size / parts, the larger ones first (some empty when size < parts).

    This is how PBG 1.0.0 hands a bucket's shuffled edges to its Hogwild workers
    (torchbiggraph/util.py ``split_almost_equally``, called by train.py ``train_and_report_stats``): every
    bucket gets one slice per worker whatever its size, so the number of batches per epoch (a slice's last
    batch of each relation is partial) depends on ``workers``, and so does training.
    """
    parts = max(parts, 1)
    base, larger = divmod(size, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + base + (1 if i < larger else 0))
    return [slice(bounds[i], bounds[i + 1]) for i in range(parts)]


def process_slices(
    ctx: BatchContext,
    edges: EdgeTensors,
    slices: list[Tensor],
    batch_size: int,
    dynamic: bool,
    generator: torch.Generator,
    train: bool,
    graphs: Optional[GraphedSteps] = None,
) -> BatchStats:
    """``process_edges`` on each slice in turn, in this process: the batches PBG's workers would take
    (see ``split_almost_equally``), run one after another. On a GPU ``graphs`` (the trainer's, kept across
    buckets) replays captured steps; None there: a set for this call only."""
    if GraphedSteps.applies(ctx, train) and edges.lhs_features is None and edges.rhs_features is None:
        graphs = graphs if graphs is not None else GraphedSteps()
    else:
        graphs = None
    total = BatchStats()
    for indices in slices:
        total.add(process_edges(ctx, edges, indices, batch_size, dynamic, generator, train, graphs=graphs))
    if graphs is not None:
        total.add(graphs.collect())  # what the replays added up on the device
    return total


def process_edges(
    ctx: BatchContext,
    edges: EdgeTensors,
    indices: Tensor,
    batch_size: int,
    dynamic: bool,
    generator: torch.Generator,
    train: bool,
    graphs: Optional[GraphedSteps] = None,
) -> BatchStats:
    """Run every batch of the edges selected by ``indices`` (already shuffled), in the planned order;
    ``graphs``: the bucket's CUDA graphs when its training runs on a GPU (``process_slices`` makes them)."""
    total = BatchStats()
    if indices.numel() == 0:
        return total
    planned = PlannedSlice(edges, plan_batches(edges.rel, indices, batch_size, dynamic, generator))
    for k in range(planned.plan.num_batches):
        if ctx.stop is not None and ctx.stop():
            raise BucketAbandoned(f"given up after {k} of {planned.plan.num_batches} batches of a slice")
        total.add(planned.run(ctx, k, generator, train, graphs))
    return total


@dataclass
class BatchPlan:
    """A slice's batches, in the order a worker takes them: batch ``k`` is the edges
    ``indices[starts[k]:ends[k]]``, all of relation ``relations[k]`` (dynamic relations: mixed, 0).

    Planning first, from the generator alone, makes the batches a pure function of (slice, seed): two
    processes that plan the same slice with the same seed get the same batches, so a Hogwild worker can
    take another worker's batches by number (``hogwild.py``, the productive ``hogwild_delay``)."""

    indices: Tensor
    relations: Tensor
    starts: Tensor
    ends: Tensor
    dynamic: bool

    @property
    def num_batches(self) -> int:
        return int(self.starts.numel())


def plan_batches(rel: Tensor, indices: Tensor, batch_size: int, dynamic: bool,
                 generator: torch.Generator) -> BatchPlan:
    """PBG's batches of the edges ``indices``: contiguous with dynamic relations; otherwise grouped by
    relation (keeping the shuffled order within each group) and taken ``batch_size`` at a time from a
    relation drawn with probability proportional to its edges left."""
    if dynamic:
        starts = torch.arange(0, indices.numel(), batch_size, dtype=torch.long)
        ends = torch.clamp(starts + batch_size, max=indices.numel())
        return BatchPlan(indices, torch.zeros_like(starts), starts, ends, True)
    chosen = rel[indices]
    order = torch.argsort(chosen, stable=True)  # on the edges' device; only the sorted relations come back
    indices = indices[order]
    rel_values, counts = torch.unique_consecutive(chosen[order].cpu(), return_counts=True)
    offsets = torch.cumsum(counts, 0) - counts
    left = counts.clone()
    relations: list[int] = []
    starts_list: list[int] = []
    sizes: list[int] = []
    remaining = int(left.sum())
    while remaining > 0:
        group = 0 if len(left) == 1 else int(torch.multinomial(left.double(), 1, generator=generator))
        size = min(batch_size, int(left[group]))
        relations.append(int(rel_values[group]))
        starts_list.append(int(offsets[group] + counts[group] - left[group]))
        sizes.append(size)
        left[group] -= size
        remaining -= size
    starts = torch.tensor(starts_list, dtype=torch.long)
    return BatchPlan(indices, torch.tensor(relations, dtype=torch.long), starts,
                     starts + torch.tensor(sizes, dtype=torch.long), False)


class PlannedSlice:
    """A plan over a bucket's edges: any of its batches runs by number, its edges gathered when it runs
    (a worker that takes a few of another slice's batches gathers only those)."""

    def __init__(self, edges: EdgeTensors, plan: BatchPlan) -> None:
        self.edges = edges
        self.plan = plan

    def run(self, ctx: BatchContext, k: int, generator: torch.Generator, train: bool,
            graphs: Optional[GraphedSteps] = None) -> BatchStats:
        """Batch ``k`` of the plan; batches with feature lists run eagerly."""
        plan, edges = self.plan, self.edges
        chosen = plan.indices[int(plan.starts[k]):int(plan.ends[k])]
        relation = int(plan.relations[k])
        if graphs is not None and edges.lhs_features is None and edges.rhs_features is None:
            return graphs.run_edges(ctx, relation, edges, chosen, plan.dynamic, generator)
        lhs, rhs = edges.lhs[chosen], edges.rhs[chosen]
        rel_ids = edges.rel[chosen] if plan.dynamic else None
        if edges.lhs_features is None and edges.rhs_features is None:
            return run_batch(ctx, relation, lhs, rhs, rel_ids, generator=generator, train=train)
        on_cpu = chosen.cpu()
        return run_batch(ctx, relation, lhs, rhs, rel_ids, generator=generator, train=train,
                         lhs_features=select_features(edges.lhs_features, on_cpu),
                         rhs_features=select_features(edges.rhs_features, on_cpu))
