"""CUDA graphs for the GPU training step: each full batch of a relation is recorded once, then replayed.

At PBG's batch sizes a GPU step is a few hundred microseconds of device work behind a few
milliseconds of Python and ~150 kernel launches (bench/RESULTS.md has the profile). The static-shape
path of ``step.run_batch`` makes every full batch of a relation the same kernels on the same shapes
with no host synchronisation, so it can be captured into a CUDA graph: afterwards a batch is a copy
of its ids into fixed buffers and one replay. Partial batches (the last of each relation's edges) and
``all_negs`` relations run eagerly; batches with feature lists never come here.

A ``GraphedSteps`` lives as long as its trainer (``BucketRunner``), and a graph is kept for every later
bucket that trains the same relation on the same tables: a graph reads and writes its tables at the
addresses they had when it was captured, so it is filed under those addresses and shapes (and the
learning rates it baked in), and replayed only for a bucket whose tables are the same tensors there. A
GPU that holds every partition (job/train/residency/budget.py, ``device_capacity``) keeps them at the same
addresses for the whole run, so a P=4 run captures each relation's graph once per (lhs, rhs) pair of
partitions, in the first pass, instead of once per bucket of every pass. At most ``MAX_GRAPHS`` are kept
(the least recently replayed goes). Capturing is an optimisation only: if it fails, training goes on
eagerly.
"""

from __future__ import annotations

import gc
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from job.model.scoring import Table
from job.train.batch.rowops import cached_tensors
from job.train.batch.step import BatchContext, BatchStats, draw_negatives, run_batch
from job.train.inputs import EdgeTensors

logger = logging.getLogger("biggraph")

# eager runs of a (relation, batch size) before it is captured: they create the lazily built tensors
# (masks, scratch arrays, position ranges) outside the graph's memory pool
WARMUP_STEPS = 1
MAX_GRAPHS = 256  # graphs kept at most (each holds its batch's intermediates in the shared pool)
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


GraphKey = tuple[object, ...]


def _table_key(table: Table) -> tuple[int, tuple[int, ...], int, tuple[int, ...]]:
    """Where a graph finds a table: its tensors' addresses and shapes (no optimizer state: a frozen type)."""
    sums = table.optim_sum
    return (table.weight.data_ptr(), tuple(table.weight.shape),
            0 if sums is None else sums.data_ptr(), () if sums is None else tuple(sums.shape))


class GraphedSteps:
    """Runs training batches, replaying a captured graph where one applies; kept across buckets."""

    disabled_reason: Optional[str] = None  # set once for the process when a capture fails
    replays = 0  # batches run by replaying a graph, in this process (tests read it)
    captures = 0  # graphs captured, in this process (tests read it)

    def __init__(self) -> None:
        self.seen: dict[GraphKey, int] = {}
        self.graphs: OrderedDict[GraphKey, _Graph] = OrderedDict()
        self.pool = torch.cuda.graph_pool_handle()  # the graphs never run concurrently: one pool for all
        # the statistics every replay adds to, inside its graph (float64: a 338M-edge bucket's loss sum); read and
        # zeroed once per call of ``process_slices`` (``collect``) instead of cloned and added up after every batch
        self.totals: Optional[Tensor] = None
        self.stream: Optional[torch.cuda.Stream] = None

    @staticmethod
    def key(ctx: BatchContext, rel_idx: int, num_pos: int) -> GraphKey:
        """What a graph of relation ``rel_idx`` baked in: the batch size, its tables' addresses and shapes, the
        entity and relation learning rates (Python numbers in its kernels' arguments)."""
        optimizer = ctx.relation_optimizer
        return (rel_idx, num_pos, ctx.entity_lr, None if optimizer is None else optimizer.scale,
                _table_key(ctx.lhs_tables[rel_idx]), _table_key(ctx.rhs_tables[rel_idx]))

    @staticmethod
    def applies(ctx: BatchContext, train: bool) -> bool:
        table = next(iter(ctx.lhs_tables.values()), None)
        return (train and GraphedSteps.disabled_reason is None and ctx.config.cuda_graphs
                and table is not None and table.weight.device.type == "cuda")

    def run_edges(self, ctx: BatchContext, rel_idx: int, edges: EdgeTensors, chosen: Tensor, dynamic: bool,
                  generator: Optional[torch.Generator]) -> BatchStats:
        """The batch of ``edges`` at positions ``chosen``: where its graph is captured, the edges are gathered
        straight into the graph's inputs (three kernels, then the replay); otherwise as ``run``."""
        config = ctx.config
        num_pos = int(chosen.shape[0])
        if (num_pos == config.batch_size and not config.relations[rel_idx].all_negs
                and GraphedSteps.disabled_reason is None):
            key = self.key(ctx, rel_idx, num_pos)
            captured = self.graphs.get(key)
            if captured is not None:
                # first, as ``run`` draws them; left on the host, copied straight into the graph's inputs
                negatives = draw_negatives(ctx, rel_idx, num_pos, generator, on_host=True)
                self.graphs.move_to_end(key)
                torch.index_select(edges.lhs, 0, chosen, out=captured.lhs)
                torch.index_select(edges.rhs, 0, chosen, out=captured.rhs)
                if dynamic and captured.rel_ids is not None:
                    torch.index_select(edges.rel, 0, chosen, out=captured.rel_ids)
                return self._replay(ctx, captured, None, None, None, negatives, num_pos)
        return self.run(ctx, rel_idx, edges.lhs[chosen], edges.rhs[chosen], edges.rel[chosen] if dynamic else None,
                        generator)

    def _capture_stream(self) -> torch.cuda.Stream:
        """The stream graphs are captured on (one per set: capture needs a stream other than the default)."""
        if self.stream is None:
            self.stream = torch.cuda.Stream()
        return self.stream

    def release(self) -> None:
        """Destroy every graph now (once the card is done with them), outside any capture."""
        torch.cuda.synchronize()
        self.graphs.clear()
        self.seen.clear()
        self.totals = None

    def collect(self) -> BatchStats:
        """What the replays since the last call added up (0-dim device tensors, read once by the bucket's totals),
        the sums then zeroed; counts are not here (each replay returns its own)."""
        out = BatchStats()
        if self.totals is not None:
            sums = self.totals.clone()
            self.totals.zero_()
            for index, name in enumerate(_STAT_FIELDS):
                setattr(out, name, sums[index])
        return out

    def run(self, ctx: BatchContext, rel_idx: int, lhs: Tensor, rhs: Tensor, rel_ids: Optional[Tensor],
            generator: Optional[torch.Generator]) -> BatchStats:
        config = ctx.config
        relation = config.relations[rel_idx]
        num_pos = int(lhs.shape[0])
        # (featurized sides never get here: process_edges keeps batches with feature lists off this path)
        eager = num_pos != config.batch_size or relation.all_negs or GraphedSteps.disabled_reason is not None
        # drawn here, in run_batch's order, so that graphs and eager steps consume the generator alike
        negatives = draw_negatives(ctx, rel_idx, num_pos, generator)
        if eager:
            return run_batch(ctx, rel_idx, lhs, rhs, rel_ids, generator=generator, train=True, negatives=negatives)
        key = self.key(ctx, rel_idx, num_pos)
        captured = self.graphs.get(key)
        if captured is not None:
            self.graphs.move_to_end(key)
            return self._replay(ctx, captured, lhs, rhs, rel_ids, negatives, num_pos)
        seen = self.seen.get(key, 0)
        self.seen[key] = seen + 1
        if seen < WARMUP_STEPS:
            return run_batch(ctx, rel_idx, lhs, rhs, rel_ids, generator=generator, train=True, negatives=negatives)
        return self._capture(ctx, key, lhs, rhs, rel_ids, negatives, num_pos)

    def _replay(self, ctx: BatchContext, captured: _Graph, lhs: Optional[Tensor], rhs: Optional[Tensor],
                rel_ids: Optional[Tensor], negatives: tuple[Optional[Tensor], Optional[Tensor]],
                num_pos: int) -> BatchStats:
        """Replay ``captured`` on these edges (None: already gathered into its inputs); its statistics go to
        ``totals``, inside the graph."""
        if lhs is not None and rhs is not None:
            captured.lhs.copy_(lhs)
            captured.rhs.copy_(rhs)
        if captured.rel_ids is not None and rel_ids is not None:
            captured.rel_ids.copy_(rel_ids)
        for buffer, value in ((captured.lhs_neg, negatives[0]), (captured.rhs_neg, negatives[1])):
            if buffer is not None and value is not None:
                buffer.copy_(value, non_blocking=True)
        captured.graph.replay()
        GraphedSteps.replays += 1
        if ctx.relation_optimizer is not None:
            ctx.relation_optimizer.steps += 1  # a CPU counter: the graph does not replay it
        return BatchStats(count=num_pos)

    def _capture(self, ctx: BatchContext, key: GraphKey, lhs: Tensor, rhs: Tensor, rel_ids: Optional[Tensor],
                 negatives: tuple[Optional[Tensor], Optional[Tensor]], num_pos: int) -> BatchStats:
        rel_idx = int(key[0])  # type: ignore[call-overload]
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
        if self.totals is None:  # outside the graph's pool: every graph adds to the same sums
            self.totals = torch.zeros(len(_STAT_FIELDS), dtype=torch.float64, device=static_lhs.device)
        capture_stream = self._capture_stream()
        capture_stream.wait_stream(torch.cuda.current_stream())
        # Not ``torch.cuda.graph``: it synchronises the card and empties the allocator's cache before every capture
        # (and, in some torch versions, collects garbage), tens of milliseconds each, paid per captured key: 160 keys
        # of a P=4 pass cost more than its training. The collector is held off meanwhile instead: a graph that it
        # destroyed during the capture (another trainer's, say) would break it.
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.stream(capture_stream):
                # recorded, not run: the step above already applied this batch
                graph.capture_begin(self.pool, capture_error_mode="thread_local")
                try:
                    outputs = run_batch(ctx, rel_idx, static_lhs, static_rhs, static_rel, generator=None, train=True,
                                        negatives=static_neg)
                    for index, name in enumerate(_STAT_FIELDS):
                        value = getattr(outputs, name)
                        if isinstance(value, Tensor):
                            self.totals[index].add_(value)
                finally:
                    graph.capture_end()
        except RuntimeError as err:
            GraphedSteps.disabled_reason = str(err).splitlines()[0] if str(err) else type(err).__name__
            logger.warning("CUDA graph capture failed (%s); training on without graphs", GraphedSteps.disabled_reason)
            return stats
        finally:
            if collecting:
                gc.enable()
            if optimizer is not None and steps_before is not None:
                optimizer.steps.copy_(steps_before)
        self.graphs[key] = _Graph(graph, static_lhs, static_rhs, static_rel, static_neg[0], static_neg[1], outputs,
                                  cached_tensors())
        GraphedSteps.captures += 1
        self.seen.pop(key, None)
        while len(self.graphs) > MAX_GRAPHS:
            self.graphs.popitem(last=False)
        return stats
