"""Figures computed now from a checkpoint's tensors: per-relation MRR on sampled edges, a PCA of sampled embeddings.

Training stats do not break MRR down by relation, and a projection needs the embeddings themselves, so these
read the checkpoint (``build_report`` turns any failure here into a note on the page, not a failed report).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from job.config import ConfigSchema
from job.formats import entities as entity_format
from job.formats.checkpoint import EMBEDDING_DATASET, CheckpointStorage


def _relation_names(config: ConfigSchema) -> list[str]:
    if not config.dynamic_relations:
        return [r.name for r in config.relations]
    try:
        return entity_format.read_dynamic_rel_names(config.entity_path)
    except Exception:  # names are cosmetic
        count = entity_format.read_dynamic_rel_count(config.entity_path)
        return [f"relation {i}" for i in range(count)]


def relation_mrr(config: ConfigSchema, edge_path: str, budget: int, seed: int
                 ) -> tuple[list[tuple[str, float, int]], str]:
    """MRR per relation on at most ``budget`` edges, ranked bucket by bucket under the config's
    ``eval_protocol`` (``auto`` decided as in training, by the largest partition); returns the rows and the
    protocol used."""
    # torch and the trainer load only when this figure is computed (--relation-edges 0 skips it)
    import torch

    from job.eval_protocol import largest_partition, resolve_protocol
    from job.evaluation import CheckpointReader, read_checked_edges
    from job.formats import edges as edge_format
    from job.train.batch.step import BatchStats
    from job.train.inputs import EdgeTensors
    from job.train.trainer import bucket_grid

    reader = CheckpointReader(config)
    protocol = resolve_protocol(config.eval_protocol, config, largest_partition(config, reader.counts))
    names = _relation_names(config)
    nparts_lhs, nparts_rhs = bucket_grid(config)
    buckets = [(lhs, rhs) for lhs in range(nparts_lhs) for rhs in range(nparts_rhs)]
    per_bucket = max(1, budget // len(buckets))
    generator = torch.Generator()
    generator.manual_seed(seed)
    totals: dict[int, BatchStats] = {}
    for lhs_part, rhs_part in buckets:
        url = edge_format.edges_file(edge_path, lhs_part, rhs_part)
        count = edge_format.count_edges(url)
        if count == 0:
            continue
        arrays = read_checked_edges(reader, edge_path, lhs_part, rhs_part, 0, min(count, per_bucket))
        edges = EdgeTensors(torch.from_numpy(arrays.rel.astype(np.int64)), torch.from_numpy(arrays.lhs.astype(np.int64)),
                            torch.from_numpy(arrays.rhs.astype(np.int64)))
        for rel, stats in _bucket_relation_stats(reader, protocol, edges, lhs_part, rhs_part, generator).items():
            totals.setdefault(rel, BatchStats()).add(stats)
    out = []
    for rel, stats in sorted(totals.items()):
        if stats.num_ranks:
            name = names[rel] if rel < len(names) else f"relation {rel}"
            out.append((name, stats.ranking_metrics()["mrr"], stats.count))
    return out, protocol


def _bucket_relation_stats(reader: Any, protocol: str, edges: Any, lhs_part: int, rhs_part: int,
                           generator: Any) -> dict[int, Any]:
    """One bucket's ranks per relation id, under ``protocol``."""
    import torch

    from job.model.scoring import Table
    from job.train.batch.batching import process_edges
    from job.train.batch.ranking import rank_bucket
    from job.train.batch.step import BatchContext

    config = reader.config
    lhs_tables = {i: Table(reader.partition(r.lhs, reader.part_of(r.lhs, lhs_part)), None)
                  for i, r in enumerate(config.relations)}
    rhs_tables = {i: Table(reader.partition(r.rhs, reader.part_of(r.rhs, rhs_part)), None)
                  for i, r in enumerate(config.relations)}
    ctx = BatchContext(config, reader.model, None, lhs_tables, rhs_tables, config.eval_num_batch_negs,
                       config.eval_num_uniform_negs)
    edges = edges.to(reader.device)
    out = {}
    for rel in torch.unique(edges.rel).tolist():
        selection = torch.nonzero(edges.rel == rel).flatten()
        with torch.no_grad():
            if protocol == "pbg":
                out[int(rel)] = process_edges(ctx, edges, selection, config.batch_size, config.dynamic_relations,
                                              generator, False)
            else:
                out[int(rel)] = rank_bucket(config, reader.model, lhs_tables, rhs_tables, edges, selection, protocol,
                                            generator)
    return out


def embedding_sample(checkpoint: CheckpointStorage, version: int, config: ConfigSchema, sample: int,
                     seed: int) -> tuple[dict[str, np.ndarray], dict[str, list[str]]]:
    """Up to ``sample`` rows over every (type, partition), in proportion to size (each type gets some)."""
    rng = np.random.default_rng(seed)
    sizes: dict[tuple[str, int], int] = {}
    for entity_type, entity in config.entities.items():
        for part in range(entity.num_partitions):
            with checkpoint.open_partition(version, entity_type, part) as handle:
                sizes[(entity_type, part)] = int(handle[EMBEDDING_DATASET].shape[0])
    total = sum(sizes.values())
    rows: dict[str, list[np.ndarray]] = {}
    names: dict[str, list[str]] = {}
    for (entity_type, part), size in sizes.items():
        if size == 0 or sample == 0:
            continue
        take = min(size, max(min(size, 20), round(sample * size / max(total, 1))))
        idx = np.sort(rng.choice(size, size=take, replace=False))
        with checkpoint.open_partition(version, entity_type, part) as handle:  # checked when the block ends
            dataset = handle[EMBEDDING_DATASET]
            block = dataset[...] if size <= 100_000 else dataset[idx.tolist()]
        rows.setdefault(entity_type, []).append(np.asarray(block[idx] if size <= 100_000 else block, dtype=np.float64))
        try:
            if size <= 1_000_000 and entity_format.has_entity_names(config.entity_path, entity_type, part):
                all_names = entity_format.read_entity_names(config.entity_path, entity_type, part)
                names.setdefault(entity_type, []).extend(all_names[i] for i in idx)
            else:
                names.setdefault(entity_type, []).extend(f"{entity_type}/{part}/{i}" for i in idx)
        except Exception:  # names are cosmetic
            names.setdefault(entity_type, []).extend(f"{entity_type}/{part}/{i}" for i in idx)
    return {t: np.concatenate(r) for t, r in rows.items()}, names


def pca_2d(samples: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], tuple[float, float]]:
    """Project every type's rows on the first two principal axes of all of them (numpy SVD)."""
    dims = {a.shape[1] for a in samples.values()}
    if not samples or len(dims) != 1:
        return {}, (0.0, 0.0)
    stacked = np.concatenate(list(samples.values()))
    mean = stacked.mean(axis=0)
    centred = stacked - mean
    _, singular, vt = np.linalg.svd(centred, full_matrices=False)
    axes = vt[:2]
    if axes.shape[0] < 2:
        axes = np.vstack([axes, np.zeros_like(axes)])
    variance = singular**2
    share = variance / variance.sum() if variance.sum() > 0 else np.zeros_like(variance)
    explained = (float(share[0]) if len(share) > 0 else 0.0, float(share[1]) if len(share) > 1 else 0.0)
    return {t: (a - mean) @ axes.T for t, a in samples.items()}, explained
