"""``biggraph eval``: ranking metrics of a checkpoint on a set of edges, labelled with their protocol.

The protocols (``--candidates``, else the config's ``eval_protocol``; job/eval_protocol.py):

- ``all``: each positive is ranked against every entity of the corrupted side's type,
  across all of its partitions (streamed one partition and one block at a time, so
  memory stays bounded). ``--filter`` directories hold the known true edges, which are
  removed from the candidates (the standard "filtered" setting of link prediction;
  PBG's filtered evaluator only supports one unpartitioned type, this one does not
  have that limit).
- ``sampled``: within each bucket, against the distinct entities among the chunk's positives
  and the uniform draws (eval_num_batch_negs / eval_num_uniform_negs), the positive left out
  (job/train/batch/ranking.py).
- ``pbg``: PBG's ``torchbiggraph_eval`` exactly: the same draws, every one counted (repeats and
  draws of the positive itself included), so ranks can exceed the number of entities.
- ``auto`` (the default): ``all`` when no type has more entities than a sampled rank draws, else
  ``sampled`` (``pbg`` for featurized types); with ``--filter``, ``all``.

Ranks count candidates scoring at least the positive (ties count against, as PBG
does). Each edge gives two ranks (corrupting lhs and rhs) unless a side's negatives are
disabled. Metrics: MRR, Hits@1/10/50, AUC (fraction of candidates scored below the
positive), mean rank; the result also says ``protocol`` and ``filtered``.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Any, Optional

import numpy as np
import torch

from job.checkpoint import CheckpointManager
from job.checkpoint.journal_checks import GrowInputs
from job.config import ConfigSchema
from job.config.choices import EVAL_PROTOCOLS
from job.errors import CheckpointError, UserError
from job.eval_protocol import largest_type, protocol_fields, protocol_label, resolve_protocol
from job.formats import edges as edge_format
from job.formats import entities as entity_format
from job.model.scoring import Model, Table
from job.monitoring import task_progress
from job.session import storage_scoped
from job.train.batch.batching import process_edges
from job.train.batch.ranking import add_ranks, prepared, rank_bucket, side_vectors
from job.train.batch.step import BatchContext, BatchStats
from job.train.inputs import bucket_grid, edge_limits, edge_tensors, pick_device, read_entity_counts
from job.types import Bucket, PartitionKey

logger = logging.getLogger("biggraph")

CANDIDATE_BLOCK = 65536
RESIDENT_BYTES = 1 << 30  # partitions the reader keeps beyond max_resident while they fit in this (CheckpointReader)


class CheckpointReader:
    """Loads a committed checkpoint's model and partitions on demand (an LRU of partitions).

    Ranking against every entity visits every partition of the candidate type for each relation and side of each
    bucket, in the same cyclic order: an LRU smaller than that cycle misses every time (P=16 with 4 kept: 82k loads
    of 256 buckets x 10 relations x 2 sides x 16, half an hour from local files on a loaded 2-vCPU machine). So the
    reader keeps at least ``max_resident`` partitions, and more while they take at most ``resident_bytes``."""

    def __init__(self, config: ConfigSchema, version: Optional[int] = None, max_resident: int = 4,
                 resident_bytes: int = RESIDENT_BYTES) -> None:
        self.config = config
        # a grown version's input is published first, if a crash left it unpublished
        committed = CheckpointManager.reader(config.checkpoint_path, version, GrowInputs.of(config))
        self.checkpoint, self.version = committed.checkpoint, committed.version
        if not self.checkpoint.has_model(self.version):
            raise CheckpointError(f"{self.checkpoint.model_file(self.version)}: missing (no checkpoint version {self.version})")
        self.counts = read_entity_counts(config)
        num_dynamic = entity_format.read_dynamic_rel_count(config.entity_path) if config.dynamic_relations else 0
        self.num_dynamic = num_dynamic
        # the training device (`device`, `num_gpus`): ranking against every entity is matrix products
        self.device = pick_device(config)
        self.model = Model(config, num_dynamic)
        params, _, _ = self.checkpoint.load_model(self.version)
        self.model.load_public_state_dict(params, self.checkpoint.model_file(self.version))
        self.model.to(self.device)
        self.model.eval()
        self._cache: OrderedDict[PartitionKey, torch.Tensor] = OrderedDict()
        self._max_resident = max_resident
        # within the pod's memory_budget (the chart's eval stage): the partitions kept beyond max_resident take at
        # most half of it, the rest being the model, a bucket's edges and the ranking's scores
        budget = config.memory_budget_bytes
        self._resident_bytes = resident_bytes if budget is None else min(resident_bytes, budget // 2)
        self.loads = 0  # partitions read from the checkpoint (a partition evicted and needed again counts again)

    def partition(self, entity_type: str, part: int) -> torch.Tensor:
        key = (entity_type, part)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        array, _ = self.checkpoint.load_entity_partition(self.version, entity_type, part)
        expected = self.counts[entity_type][part]
        if array.shape[0] != expected:
            raise CheckpointError(
                f"{self.checkpoint.partition_file(self.version, entity_type, part)}: {array.shape[0]} rows but "
                f"entity_count_{entity_type}_{part}.txt says {expected}"
            )
        tensor = torch.from_numpy(array).to(self.device)
        self.loads += 1
        self._cache[key] = tensor
        while len(self._cache) > self._max_resident and (
                sum(t.numel() * t.element_size() for t in self._cache.values()) > self._resident_bytes):
            self._cache.popitem(last=False)
        return tensor

    def part_of(self, entity_type: str, bucket_part: int) -> int:
        return bucket_part if self.config.entities[entity_type].num_partitions > 1 else 0


def _finalise(stats: BatchStats, elapsed: float, protocol: str, filtered: bool) -> dict[str, Any]:
    metrics: dict[str, Any] = dict(stats.ranking_metrics())
    metrics["count"] = stats.count
    metrics["num_ranks"] = stats.num_ranks
    metrics["seconds"] = round(elapsed, 3)
    metrics.update(protocol_fields(protocol, filtered))
    return metrics


def choose_protocol(config: ConfigSchema, counts: dict[str, list[int]], candidates: Optional[str],
                    filtered: bool) -> str:
    """The protocol of an evaluation: ``candidates`` (else ``eval_protocol``) resolved against the entity counts."""
    requested = candidates or config.eval_protocol
    if requested not in EVAL_PROTOCOLS:
        raise UserError(f"--candidates {requested}: expected one of {', '.join(EVAL_PROTOCOLS)}")
    if filtered:
        if requested in ("sampled", "pbg"):
            raise UserError(f"--filter needs all candidates (--candidates all or auto), not {requested}: filtered "
                            "ranks are defined against every entity")
        requested = "all"
    protocol = resolve_protocol(requested, config, largest_type(config, counts))
    featurized = sorted(t for t, e in config.entities.items() if e.featurized)
    if featurized and protocol in ("all", "sampled"):
        raise UserError(f"--candidates {protocol} cannot rank featurized entity types ({', '.join(featurized)}): "
                        "their entities are bags of features, not rows; use --candidates pbg")
    return protocol


@storage_scoped
def evaluate(
    config: ConfigSchema,
    filter_paths: Optional[list[str]] = None,
    candidates: Optional[str] = None,
    version: Optional[int] = None,
) -> dict[str, Any]:
    """Evaluate the checkpoint of ``config`` on the edges of ``config.edge_paths``.

    ``candidates``: 'auto', 'all', 'sampled' or 'pbg' (None: the config's ``eval_protocol``)."""
    started = time.perf_counter()
    filter_paths = filter_paths or []
    reader = CheckpointReader(config, version)
    protocol = choose_protocol(config, reader.counts, candidates, bool(filter_paths))
    if protocol == "all":
        stats = _evaluate_all(reader, filter_paths)
    else:
        stats = _evaluate_sampled(reader, protocol)
    filtered = bool(filter_paths)
    metrics = _finalise(stats, time.perf_counter() - started, protocol, filtered)
    logger.info("eval of checkpoint version %d over %d edges (%s): MRR %.4f, hits@10 %.4f, mean rank %.1f",
                reader.version, stats.count, protocol_label(protocol, filtered), metrics["mrr"], metrics["hits@10"],
                metrics["mean_rank"])
    return metrics


def read_checked_edges(reader: CheckpointReader, edge_path: str, lhs: int, rhs: int, begin: int = 0,
                       end: Optional[int] = None) -> edge_format.EdgeArrays:
    """A bucket's edges [begin, end), bounds-checked against the entity and relation counts."""
    url = edge_format.edges_file(edge_path, lhs, rhs)
    arrays = edge_format.read_edges(url, begin, end)
    edge_limits(reader.config, reader.counts, reader.num_dynamic, Bucket(lhs, rhs)).check(arrays, url, begin)
    return arrays


def _iter_bucket_edges(reader: CheckpointReader):  # generator of (bucket, EdgeTensors)
    config = reader.config
    nparts_lhs, nparts_rhs = bucket_grid(config)
    with task_progress("eval", total=len(config.edge_paths) * nparts_lhs * nparts_rhs, unit=" buckets") as bar:
        for edge_path in config.edge_paths:
            for lhs in range(nparts_lhs):
                for rhs in range(nparts_rhs):
                    arrays = read_checked_edges(reader, edge_path, lhs, rhs)
                    if len(arrays) > 0:
                        yield (lhs, rhs), edge_tensors(arrays)
                    bar.update(1)


def _evaluate_sampled(reader: CheckpointReader, protocol: str) -> BatchStats:
    """Bucket by bucket against sampled candidates: ``sampled`` (rank_bucket) or ``pbg`` (the training step)."""
    config = reader.config
    total = BatchStats()
    generator = torch.Generator()
    generator.manual_seed(config.seed or 0)
    for (lhs_part, rhs_part), edges in _iter_bucket_edges(reader):
        lhs_tables = {}
        rhs_tables = {}
        for rel_idx, relation in enumerate(config.relations):
            lhs_tables[rel_idx] = Table(reader.partition(relation.lhs, reader.part_of(relation.lhs, lhs_part)), None)
            rhs_tables[rel_idx] = Table(reader.partition(relation.rhs, reader.part_of(relation.rhs, rhs_part)), None)
        indices = torch.arange(len(edges), device=reader.device)
        if protocol == "sampled":
            total.add(rank_bucket(config, reader.model, lhs_tables, rhs_tables, edges.to(reader.device), indices,
                                  protocol, generator))
            continue
        ctx = BatchContext(config, reader.model, None, lhs_tables, rhs_tables, config.eval_num_batch_negs,
                           config.eval_num_uniform_negs)
        total.add(process_edges(ctx, edges.to(reader.device), indices, config.batch_size, config.dynamic_relations,
                                generator, False))
    return total


class TrueEdgeIndex:
    """Known true edges keyed by (relation, anchor entity) for filtered ranking, in global entity ids."""

    def __init__(self, anchors: np.ndarray, targets: np.ndarray) -> None:
        order = np.argsort(anchors, kind="stable")
        self.keys = anchors[order]
        self.values = targets[order]

    def lookup(self, queries: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(row of the query, target) pairs for every stored edge matching each query key."""
        lo = np.searchsorted(self.keys, queries, side="left")
        hi = np.searchsorted(self.keys, queries, side="right")
        lengths = hi - lo
        rows = np.repeat(np.arange(len(queries)), lengths)
        starts = np.repeat(lo - np.cumsum(lengths) + lengths, lengths)
        positions = np.arange(int(lengths.sum())) + starts
        return rows, self.values[positions]


def _global_offsets(reader: CheckpointReader) -> dict[str, np.ndarray]:
    return {t: np.concatenate(([0], np.cumsum(c)[:-1])).astype(np.int64) for t, c in reader.counts.items()}


def _build_filters(reader: CheckpointReader, filter_paths: list[str]) -> tuple[Optional[TrueEdgeIndex], Optional[TrueEdgeIndex]]:
    """Indexes for corrupting rhs (key: rel, lhs -> rhs) and lhs (key: rel, rhs -> lhs)."""
    if not filter_paths:
        return None, None
    config = reader.config
    offsets = _global_offsets(reader)
    totals = {t: int(sum(c)) for t, c in reader.counts.items()}
    span = max(totals.values()) + 1
    rhs_keys, rhs_values, lhs_keys, lhs_values = [], [], [], []
    nparts_lhs, nparts_rhs = bucket_grid(config)
    for path in filter_paths:
        for lhs_part in range(nparts_lhs):
            for rhs_part in range(nparts_rhs):
                arrays = read_checked_edges(reader, path, lhs_part, rhs_part)
                if len(arrays) == 0:
                    continue
                rel = arrays.rel
                lhs_global = np.empty_like(arrays.lhs)
                rhs_global = np.empty_like(arrays.rhs)
                for rel_idx, relation in enumerate(config.relations):
                    selected = np.ones(len(rel), bool) if config.dynamic_relations else rel == rel_idx
                    lp = reader.part_of(relation.lhs, lhs_part)
                    rp = reader.part_of(relation.rhs, rhs_part)
                    lhs_global[selected] = arrays.lhs[selected] + offsets[relation.lhs][lp]
                    rhs_global[selected] = arrays.rhs[selected] + offsets[relation.rhs][rp]
                rhs_keys.append(rel * span + lhs_global)
                rhs_values.append(rhs_global)
                lhs_keys.append(rel * span + rhs_global)
                lhs_values.append(lhs_global)
    if not rhs_keys:
        return None, None
    return (TrueEdgeIndex(np.concatenate(rhs_keys), np.concatenate(rhs_values)),
            TrueEdgeIndex(np.concatenate(lhs_keys), np.concatenate(lhs_values)))


@torch.no_grad()
def _evaluate_all(reader: CheckpointReader, filter_paths: list[str]) -> BatchStats:
    config = reader.config
    model = reader.model
    dynamic = model.num_dynamic_rels > 0
    offsets = _global_offsets(reader)
    totals = {t: int(sum(c)) for t, c in reader.counts.items()}
    span = max(totals.values()) + 1
    rhs_filter, lhs_filter = _build_filters(reader, filter_paths)
    total = BatchStats()
    for (lhs_part, rhs_part), edges in _iter_bucket_edges(reader):
        groups = [(0, torch.arange(len(edges)))] if dynamic else [
            (int(r), torch.nonzero(edges.rel == r).flatten()) for r in torch.unique(edges.rel)
        ]
        for rel_idx, selection in groups:
            if rel_idx >= len(config.relations):
                raise UserError(f"edge relation index {rel_idx} out of range ({len(config.relations)} relation types)")
            relation = config.relations[rel_idx]
            lp = reader.part_of(relation.lhs, lhs_part)
            rp = reader.part_of(relation.rhs, rhs_part)
            for start in range(0, selection.numel(), config.batch_size):
                index = selection[start:start + config.batch_size]
                lhs_ids, rhs_ids, rel = edges.lhs[index], edges.rhs[index], edges.rel[index]
                lhs_rows = reader.partition(relation.lhs, lp)[lhs_ids.to(reader.device)]
                rhs_rows = reader.partition(relation.rhs, rp)[rhs_ids.to(reader.device)]
                rel_on_device = rel.to(reader.device)
                ids = {"lhs": lhs_ids.numpy() + offsets[relation.lhs][lp], "rhs": rhs_ids.numpy() + offsets[relation.rhs][rp]}
                known = {"lhs": lhs_filter, "rhs": rhs_filter}
                batch = BatchStats(count=int(index.numel()))
                for side, anchor, positive, cand_type, cand_op in side_vectors(
                        config, model, rel_idx, lhs_rows, rhs_rows, rel_on_device if model.reciprocal else None):
                    true_global, anchor_global = ids[side], ids["rhs" if side == "lhs" else "lhs"]
                    pos = model.comparator.pos(anchor, positive)
                    filtered = None
                    true_index = known[side]
                    if true_index is not None:
                        rows, targets = true_index.lookup(rel.numpy() * span + anchor_global)
                        keep = targets != true_global[rows]
                        filtered = (rows[keep], targets[keep])
                    _rank_against_all(reader, model, cand_type, cand_op=cand_op, anchor=anchor, pos=pos,
                                      true_global=true_global, filtered=filtered,
                                      type_offsets=offsets[cand_type], out=batch)
                total.add(batch)
    return total


def _rank_against_all(
    reader: CheckpointReader,
    model: Model,
    cand_type: str,
    *,
    cand_op: Any,
    anchor: torch.Tensor,
    pos: torch.Tensor,
    true_global: np.ndarray,
    filtered: Optional[tuple[np.ndarray, np.ndarray]],
    type_offsets: np.ndarray,
    out: BatchStats,
) -> None:
    """Count, per positive, candidates of ``cand_type`` scoring >= / < the positive, excluding itself and filtered ones."""
    num = anchor.shape[0]
    device = anchor.device
    at_least = torch.zeros(num, dtype=torch.float64, device=device)
    below = torch.zeros(num, dtype=torch.float64, device=device)
    ties = torch.zeros(num, dtype=torch.float64, device=device)
    candidates_total = torch.zeros(num, dtype=torch.float64, device=device)
    true_t = torch.from_numpy(true_global).to(device)
    for part, count in enumerate(reader.counts[cand_type]):
        if count == 0:
            continue
        table = reader.partition(cand_type, part)
        base = int(type_offsets[part])
        for block_start in range(0, count, CANDIDATE_BLOCK):
            block_end = min(count, block_start + CANDIDATE_BLOCK)
            vecs = prepared(model, table[block_start:block_end], cand_type, cand_op)
            scores = model.comparator.pairwise(anchor, vecs)  # (num, block)
            valid = torch.ones_like(scores, dtype=torch.bool)
            # the positive itself is not a candidate
            own = true_t - (base + block_start)
            inside = (own >= 0) & (own < block_end - block_start)
            valid[torch.nonzero(inside).flatten(), own[inside]] = False
            if filtered is not None and len(filtered[0]):
                rows, targets = filtered
                local = targets - (base + block_start)
                sel = (local >= 0) & (local < block_end - block_start)
                if sel.any():
                    valid[torch.from_numpy(rows[sel]).to(device), torch.from_numpy(local[sel]).to(device)] = False
            p = pos.unsqueeze(1)
            at_least += ((scores >= p) & valid).sum(1).double()
            below += ((scores < p) & valid).sum(1).double()
            ties += ((scores == p) & valid).sum(1).double()
            candidates_total += valid.sum(1).double()
    add_ranks(out, at_least, below, ties, candidates_total)
