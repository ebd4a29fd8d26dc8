"""Ranks of a bucket's held-out edges under biggraph's protocols ``all`` and ``sampled`` (job/eval_protocol.py).

PBG's protocol (every sampled draw counts, repeats and draws equal to the positive included) is the
training step run without updates (``process_edges(..., train=False)``, ranks in ``step._add_ranks``), and
stays there. The two here rank each positive against a *set* of other entities, so a rank is at most the
set's size + 1:

- ``all``: every row of the corrupted side's table (the bucket's partition), the positive left out;
- ``sampled``: per chunk of ``eval_num_batch_negs`` positives, the distinct entities among the chunk's
  positives and ``eval_num_uniform_negs`` uniform draws, the positive left out (PBG's draws, deduplicated).

Ties with other entities count against the positive (as PBG and ``biggraph eval --candidates all`` do);
AUC counts them half. ``biggraph eval`` ranks against all partitions of a type with ``job.evaluation``; it
shares ``prepared``, ``side_vectors`` and ``add_ranks`` with this module.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from job.config import ConfigSchema
from job.model.scoring import Model, Table
from job.train.batch.step import BatchStats
from job.train.inputs import EdgeTensors

# candidates scored at once against a batch's anchors: bounds the (batch x block) score matrix
CANDIDATE_BLOCK = 16384

# (side, anchor vectors, this side's positive vectors, candidates' entity type, operator applied to the
# candidates or None)
SideVectors = tuple[str, Tensor, Tensor, str, Optional[torch.nn.Module]]


def prepared(model: Model, rows: Tensor, entity_type: str, operator: Any = None,
             rel: Optional[Tensor] = None) -> Tensor:
    """Rows as the comparator compares them: plus the type's global embedding, through ``operator``."""
    x = rows
    g = model.global_emb(entity_type)
    if g is not None:
        x = x + g
    if operator is not None:
        x = operator(x, rel) if model.num_dynamic_rels > 0 else operator(x)
    return model.comparator.prepare(x)


def side_vectors(config: ConfigSchema, model: Model, rel_idx: int, lhs_rows: Tensor, rhs_rows: Tensor,
                 rel: Optional[Tensor]) -> list[SideVectors]:
    """The sides to rank of a batch of one relation (or of dynamic relations ``rel``), as the model scores them:
    static relations c(u, f_r(v)) (the operator on the rhs candidates), dynamic ones transform the anchor."""
    relation = config.relations[rel_idx]
    rhs_op = model.rhs_operators[rel_idx]
    lhs_vec = prepared(model, lhs_rows, relation.lhs)
    rhs_vec = prepared(model, rhs_rows, relation.rhs)
    sides: list[SideVectors]
    if model.reciprocal:  # dynamic relations, or reciprocal_relations: the lhs side ranks via h_r
        # corrupt lhs: c(u', h_r(v)); corrupt rhs: c(g_r(u), v')
        rhs_transformed = prepared(model, rhs_rows, relation.rhs, rhs_op, rel)
        lhs_transformed = prepared(model, lhs_rows, relation.lhs, model.lhs_operators[rel_idx], rel)
        sides = [("lhs", rhs_transformed, lhs_vec, relation.lhs, None),
                 ("rhs", lhs_transformed, rhs_vec, relation.rhs, None)]
    else:
        rhs_transformed = prepared(model, rhs_rows, relation.rhs, rhs_op)
        sides = [("lhs", rhs_transformed, lhs_vec, relation.lhs, None),
                 ("rhs", lhs_vec, rhs_transformed, relation.rhs, rhs_op)]
    disabled = {"lhs": config.disable_lhs_negs, "rhs": config.disable_rhs_negs}
    return [s for s in sides if not disabled[s[0]]]


def add_ranks(out: BatchStats, at_least: Tensor, below: Tensor, ties: Tensor, candidates: Tensor) -> None:
    """Add per-positive counts of candidates scoring >= / < / == the positive (and of candidates) to ``out``."""
    ranks = at_least.double() + 1
    out.rank_sum += float(ranks.sum())
    out.reciprocal_rank_sum += float(ranks.reciprocal().sum())
    out.hits1 += float((ranks <= 1).sum())
    out.hits10 += float((ranks <= 10).sum())
    out.hits50 += float((ranks <= 50).sum())
    out.auc_sum += float(((below.double() + 0.5 * ties.double()) / candidates.double().clamp_min(1)).sum())
    out.num_ranks += int(ranks.shape[0])


def _counts(scores: Tensor, pos: Tensor, valid: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    p = pos.unsqueeze(1)
    return (((scores >= p) & valid).sum(1), ((scores < p) & valid).sum(1), ((scores == p) & valid).sum(1),
            valid.sum(1))


def _rank_all_rows(model: Model, table: Tensor, cand_type: str, cand_op: Any, anchor: Tensor, pos: Tensor,
                   own: Tensor, out: BatchStats) -> None:
    """Every row of ``table`` but the positive's own, block by block."""
    totals = [torch.zeros(anchor.shape[0], dtype=torch.long, device=anchor.device) for _ in range(4)]
    for start in range(0, table.shape[0], CANDIDATE_BLOCK):
        end = min(table.shape[0], start + CANDIDATE_BLOCK)
        scores = model.comparator.pairwise(anchor, prepared(model, table[start:end], cand_type, cand_op))
        ids = torch.arange(start, end, device=anchor.device)
        valid = ids.unsqueeze(0) != own.unsqueeze(1)
        for total, part in zip(totals, _counts(scores, pos, valid)):
            total += part
    add_ranks(out, *totals)


def _rank_sampled(config: ConfigSchema, model: Model, table: Tensor, *, cand_type: str, cand_op: Any, anchor: Tensor,
                  pos: Tensor, own: Tensor, generator: Optional[torch.Generator], out: BatchStats) -> None:
    """Per chunk, the distinct entities among the chunk's positives and the uniform draws, the positive left out."""
    num_batch, num_uniform = config.eval_num_batch_negs, config.eval_num_uniform_negs
    num_pos = anchor.shape[0]
    chunk = num_batch if num_batch > 0 else (num_uniform or num_pos)  # PBG's chunks
    for start in range(0, num_pos, chunk):
        end = min(num_pos, start + chunk)
        pieces = [own[start:end]] if num_batch > 0 else []
        if num_uniform > 0:
            # drawn by the CPU generator on every device, as training draws its negatives
            pieces.append(torch.randint(0, table.shape[0], (num_uniform,), generator=generator).to(own.device))
        ids = torch.unique(torch.cat(pieces)) if pieces else own[:0]
        scores = model.comparator.pairwise(anchor[start:end], prepared(model, table[ids], cand_type, cand_op))
        valid = ids.unsqueeze(0) != own[start:end].unsqueeze(1)
        add_ranks(out, *_counts(scores, pos[start:end], valid))


@torch.no_grad()
def rank_bucket(config: ConfigSchema, model: Model, lhs_tables: dict[int, Table], rhs_tables: dict[int, Table],
                edges: EdgeTensors, indices: Tensor, protocol: str, generator: Optional[torch.Generator]) -> BatchStats:
    """Ranks of the edges ``indices`` of a bucket under ``protocol`` (``all`` or ``sampled``); relations with
    ``all_negs`` rank against all rows under either (as PBG's do)."""
    if protocol not in ("all", "sampled"):
        raise ValueError(f"rank_bucket ranks under 'all' or 'sampled', not {protocol!r}")
    total = BatchStats()
    dynamic = model.num_dynamic_rels > 0
    device = next(iter(lhs_tables.values())).weight.device
    indices = indices.to(edges.rel.device)
    rels = edges.rel[indices]
    groups = [(0, indices)] if dynamic else [(int(r), indices[rels == r]) for r in torch.unique(rels).tolist()]
    for rel_idx, selection in groups:
        relation = config.relations[rel_idx]
        lhs_table, rhs_table = lhs_tables[rel_idx].weight, rhs_tables[rel_idx].weight
        for start in range(0, selection.numel(), config.batch_size):
            index = selection[start:start + config.batch_size]
            lhs_ids, rhs_ids = edges.lhs[index].to(device), edges.rhs[index].to(device)
            rel = edges.rel[index].to(device) if dynamic else None
            batch = BatchStats(count=int(index.numel()))
            for side, anchor, positive, cand_type, cand_op in side_vectors(
                    config, model, rel_idx, lhs_table[lhs_ids], rhs_table[rhs_ids], rel):
                table, own = (lhs_table, lhs_ids) if side == "lhs" else (rhs_table, rhs_ids)
                pos = model.comparator.pos(anchor, positive)
                if protocol == "all" or relation.all_negs:
                    _rank_all_rows(model, table, cand_type, cand_op, anchor, pos, own, batch)
                else:
                    _rank_sampled(config, model, table, cand_type=cand_type, cand_op=cand_op, anchor=anchor, pos=pos,
                                  own=own, generator=generator, out=batch)
            total.add(batch)
    return total
