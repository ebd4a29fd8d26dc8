"""CUDA graphs for the GPU training step: each full batch of a relation is recorded once, then replayed.

At PBG's batch sizes a GPU step is a few hundred microseconds of device work behind a few
milliseconds of Python and ~150 kernel launches (bench/RESULTS.md has the profile). The static-shape
path of ``step.run_batch`` makes every full batch of a relation the same kernels on the same shapes
with no host synchronisation, so it can be captured into a CUDA graph: afterwards a batch is a copy
of its ids into fixed buffers and one replay. Partial batches (the last of each relation's edges) and
``all_negs`` relations run eagerly; batches with feature lists never come here.

A ``GraphedSteps`` lives for one bucket: the graphs point at that bucket's partitions, which are
swapped out afterwards. Capturing is an optimisation only: if it fails, training goes on eagerly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from job.train.batch.rowops import cached_tensors
from job.train.batch.step import BatchContext, BatchStats, draw_negatives, run_batch

logger = logging.getLogger("biggraph")

# eager runs of a (relation, batch size) before it is captured: they create the lazily built tensors
# (masks, scratch arrays, position ranges) outside the graph's memory pool
WARMUP_STEPS = 1
_STAT_FIELDS = ("loss", "reg", "violators_lhs", "violators_rhs")


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    lhs: Tensor
    rhs: Tensor
    rel_ids: Optional[Tensor]
    lhs_neg: Optional[Tensor]
    rhs_neg: Optional[Tensor]
    stats: BatchStats  # its tensor fields are the graph's outputs, overwritten by every replay
    keepalive: list[Tensor]  # the cached tensors the graph reads and writes (see step.cached_tensors)


class GraphedSteps:
    """Runs the training batches of one bucket, replaying a captured graph where one applies."""

    disabled_reason: Optional[str] = None  # set once for the process when a capture fails
    replays = 0  # batches run by replaying a graph, in this process (tests read it)

    def __init__(self, ctx: BatchContext) -> None:
        self.ctx = ctx
        self.seen: dict[tuple[int, int], int] = {}
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle()  # the graphs never run concurrently: one pool for all

    @staticmethod
    def applies(ctx: BatchContext, train: bool) -> bool:
        table = next(iter(ctx.lhs_tables.values()), None)
        return (train and GraphedSteps.disabled_reason is None and ctx.config.cuda_graphs
                and table is not None and table.weight.device.type == "cuda")

    def run(self, rel_idx: int, lhs: Tensor, rhs: Tensor, rel_ids: Optional[Tensor],
            generator: Optional[torch.Generator]) -> BatchStats:
        ctx = self.ctx
        config = ctx.config
        relation = config.relations[rel_idx]
        num_pos = int(lhs.shape[0])
        # (featurized sides never get here: process_edges keeps batches with feature lists off this path)
        eager = num_pos != config.batch_size or relation.all_negs or GraphedSteps.disabled_reason is not None
        # drawn here, in run_batch's order, so that graphs and eager steps consume the generator alike
        negatives = draw_negatives(ctx, rel_idx, num_pos, generator)
        if eager:
            return run_batch(ctx, rel_idx, lhs, rhs, rel_ids, generator=generator, train=True, negatives=negatives)
        key = (rel_idx, num_pos)
        captured = self.graphs.get(key)
        if captured is not None:
            return self._replay(captured, lhs, rhs, rel_ids, negatives, num_pos)
        seen = self.seen.get(key, 0)
        self.seen[key] = seen + 1
        if seen < WARMUP_STEPS:
            return run_batch(ctx, rel_idx, lhs, rhs, rel_ids, generator=generator, train=True, negatives=negatives)
        return self._capture(key, lhs, rhs, rel_ids, negatives, num_pos)

    def _replay(self, captured: _Graph, lhs: Tensor, rhs: Tensor, rel_ids: Optional[Tensor],
                negatives: tuple[Optional[Tensor], Optional[Tensor]], num_pos: int) -> BatchStats:
        captured.lhs.copy_(lhs)
        captured.rhs.copy_(rhs)
        if captured.rel_ids is not None and rel_ids is not None:
            captured.rel_ids.copy_(rel_ids)
        for buffer, value in ((captured.lhs_neg, negatives[0]), (captured.rhs_neg, negatives[1])):
            if buffer is not None and value is not None:
                buffer.copy_(value, non_blocking=True)
        captured.graph.replay()
        GraphedSteps.replays += 1
        if self.ctx.relation_optimizer is not None:
            self.ctx.relation_optimizer.steps += 1  # a CPU counter: the graph does not replay it
        out = BatchStats(count=num_pos)
        for name in _STAT_FIELDS:
            value = getattr(captured.stats, name)
            setattr(out, name, value.clone() if isinstance(value, Tensor) else value)
        return out

    def _capture(self, key: tuple[int, int], lhs: Tensor, rhs: Tensor, rel_ids: Optional[Tensor],
                 negatives: tuple[Optional[Tensor], Optional[Tensor]], num_pos: int) -> BatchStats:
        ctx = self.ctx
        rel_idx = key[0]
        static_lhs, static_rhs = lhs.clone(), rhs.clone()
        static_rel = rel_ids.clone() if rel_ids is not None else None
        lhs_neg, rhs_neg = negatives
        static_neg = (None if lhs_neg is None else lhs_neg.clone(), None if rhs_neg is None else rhs_neg.clone())
        # this batch's real step, on a side stream as capturing requires (cuBLAS and autograd set-up)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            stats = run_batch(ctx, rel_idx, static_lhs, static_rhs, static_rel, generator=None, train=True, negatives=static_neg)
        torch.cuda.current_stream().wait_stream(side)
        optimizer = ctx.relation_optimizer
        steps_before = optimizer.steps.clone() if optimizer is not None else None
        graph = torch.cuda.CUDAGraph()
        try:
            # recorded, not run: the step above already applied this batch
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                outputs = run_batch(ctx, rel_idx, static_lhs, static_rhs, static_rel, generator=None, train=True,
                                    negatives=static_neg)
        except RuntimeError as err:
            GraphedSteps.disabled_reason = str(err).splitlines()[0] if str(err) else type(err).__name__
            logger.warning("CUDA graph capture failed (%s); training on without graphs", GraphedSteps.disabled_reason)
            return stats
        finally:
            if optimizer is not None and steps_before is not None:
                optimizer.steps.copy_(steps_before)
        self.graphs[key] = _Graph(graph, static_lhs, static_rhs, static_rel, static_neg[0], static_neg[1], outputs,
                                  cached_tensors())
        return stats
