"""Link-prediction metrics of an archived model against every entity, in numpy (no torch).

The ranking protocol is ``biggraph eval --candidates all [--filter ...]``'s (job/evaluation.py):
both sides of each edge are corrupted with every entity of that side's type; a candidate
counts against the positive when its score is >= the positive's (pessimistic ties); the
positive itself and, when filtering, every other known true edge are left out. Corrupting
the lhs scores c(u', op_r(v)); corrupting the rhs scores c(u, op_r(v')) for static relations
and c(op^lhs_r(u), v') for dynamic ones (PBG's reverse direction) and reciprocal_relations.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Optional

import numpy as np

BLOCK = 1024


def _filter_index(edges: Optional[np.ndarray]) -> tuple[dict[tuple[int, int], np.ndarray], dict[tuple[int, int], np.ndarray]]:
    """(rel, lhs) -> true rhs rows and (rel, rhs) -> true lhs rows, from (rel, lhs, rhs) triples."""
    by_lhs: dict[tuple[int, int], list[int]] = defaultdict(list)
    by_rhs: dict[tuple[int, int], list[int]] = defaultdict(list)
    if edges is not None:
        for rel, lhs, rhs in edges.tolist():
            by_lhs[(rel, lhs)].append(rhs)
            by_rhs[(rel, rhs)].append(lhs)
    return ({k: np.asarray(v, dtype=np.int64) for k, v in by_lhs.items()},
            {k: np.asarray(v, dtype=np.int64) for k, v in by_rhs.items()})


def _ranks(model: Any, anchor: np.ndarray, positive: np.ndarray, cands: np.ndarray, true_rows: np.ndarray,
           anchor_rows: np.ndarray, rel_ids: np.ndarray, filters: dict[tuple[int, int], np.ndarray]) -> np.ndarray:
    comparator = model.comparator
    pos = comparator.pos(anchor, positive)
    scores = comparator.pairwise(anchor, cands)
    valid = np.ones(scores.shape, dtype=bool)
    valid[np.arange(len(true_rows)), true_rows] = False
    for i, (rel, row) in enumerate(zip(rel_ids.tolist(), anchor_rows.tolist())):
        targets = filters.get((rel, row))
        if targets is not None:
            valid[i, targets] = False
    return 1 + ((scores >= pos[:, None]) & valid).sum(1)


def link_prediction_metrics(model: Any, edges: np.ndarray, filter_edges: Optional[np.ndarray] = None) -> dict[str, float]:
    """MRR, Hits@1/10/50 and mean rank of ``edges``, an (E, 3) int array of (relation index, lhs row, rhs row).

    Rows are the archive's per-type row numbers (partition 0's rows first). ``filter_edges``
    (same layout) are the known true edges left out of the candidates.
    """
    config = model.config
    filters_rhs, filters_lhs = _filter_index(filter_edges)
    edges = np.asarray(edges, dtype=np.int64).reshape(-1, 3)
    ranks: list[np.ndarray] = []
    for rel_id in np.unique(edges[:, 0]).tolist():
        selected = edges[edges[:, 0] == rel_id]
        _, rel_idx, row = model._relation(int(rel_id))
        relation = model.graph.relation_types[rel_idx]
        lhs_all = model.prepared(relation.lhs)
        rhs_plain = model.prepared(relation.rhs)
        rhs_transformed = model.prepared(relation.rhs, int(rel_id), "rhs")
        if model.reciprocal:
            lhs_transformed = model.prepared(relation.lhs, int(rel_id), "lhs")
        for start in range(0, len(selected), BLOCK):
            block = selected[start:start + BLOCK]
            rels, lhs_rows, rhs_rows = block[:, 0], block[:, 1], block[:, 2]
            if not config.get("disable_lhs_negs", False):
                anchor = rhs_transformed[rhs_rows]
                ranks.append(_ranks(model, anchor, lhs_all[lhs_rows], lhs_all, lhs_rows, rhs_rows, rels, filters_lhs))
            if not config.get("disable_rhs_negs", False):
                if model.reciprocal:
                    anchor, cands = lhs_transformed[lhs_rows], rhs_plain
                else:
                    anchor, cands = lhs_all[lhs_rows], rhs_transformed
                ranks.append(_ranks(model, anchor, cands[rhs_rows], cands, rhs_rows, lhs_rows, rels, filters_rhs))
    if not ranks:
        return {"mrr": 0.0, "hits@1": 0.0, "hits@10": 0.0, "hits@50": 0.0, "mean_rank": 0.0, "num_ranks": 0}
    all_ranks = np.concatenate(ranks).astype(np.float64)
    return {
        "mrr": float((1.0 / all_ranks).mean()),
        "hits@1": float((all_ranks <= 1).mean()),
        "hits@10": float((all_ranks <= 10).mean()),
        "hits@50": float((all_ranks <= 50).mean()),
        "mean_rank": float(all_ranks.mean()),
        "num_ranks": int(len(all_ranks)),
    }
