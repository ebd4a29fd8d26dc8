"""One batch: gather unique rows, score, loss, backward, and the two Adagrad updates.

(The optimizers are in job/train/batch/optim.py; which rows a batch gathers, and the row bookkeeping, in
job/train/batch/rowops.py.)

This is the hot path of training and of sampled evaluation. It runs unchanged in the
main process (workers=1) and in each Hogwild worker; all tensors it updates live in
shared memory, and updates are unsynchronised by design (Hogwild!).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from job.config import ConfigSchema
from job.model.kernel_options import DEFAULT_KERNEL_OPTIONS, KernelOptions
from job.model.losses import compute_loss, smoothed_softmax_loss
from job.model.operators import Operator
from job.model.regularizers import dura_penalty, n3_penalty
from job.model.scoring import Model, SideScores, Table
from job.model.side import Side
from job.train.batch.optim import (
    RelationAdagrad,
    cat_grads,
    renorm_rows,
    row_adagrad,
    row_adagrad_occurrences,
    row_adagrad_repeated,
)
from job.train.batch.rowops import SelectedRows, occurrences_pay, overlap, select_rows

# Both sides of a batch gather their rows together when the shared table has at most this many rows per
# positive edge (they then touch mostly the same rows); otherwise each side gathers its own.
JOINT_GATHER_ROWS_PER_EDGE = 8


@dataclass
class BatchStats:
    """Sums over a set of batches; averaged only when reported (like PBG's Stats)."""

    count: int = 0
    loss: Tensor | float = 0.0  # a 0-dim device tensor on a GPU (_statistic)
    reg: Tensor | float = 0.0
    violators_lhs: int = 0
    violators_rhs: int = 0
    rank_sum: float = 0.0
    reciprocal_rank_sum: float = 0.0
    hits1: float = 0.0
    hits10: float = 0.0
    hits50: float = 0.0
    auc_sum: float = 0.0
    num_ranks: int = 0
    extra: dict = field(default_factory=dict)

    def add(self, other: BatchStats) -> None:
        for name in ("count", "loss", "reg", "violators_lhs", "violators_rhs", "rank_sum", "reciprocal_rank_sum",
                     "hits1", "hits10", "hits50", "auc_sum", "num_ranks"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def training_metrics(self) -> dict[str, float]:
        n = max(self.count, 1)
        # on a GPU the sums are 0-dim device tensors until here (read once per bucket, not once per batch)
        return {"loss": float(self.loss) / n, "reg": float(self.reg) / n, "violators_lhs": float(self.violators_lhs) / n,
                "violators_rhs": float(self.violators_rhs) / n}

    def ranking_metrics(self) -> dict[str, float]:
        r = max(self.num_ranks, 1)
        return {"mrr": self.reciprocal_rank_sum / r, "hits@1": self.hits1 / r, "hits@10": self.hits10 / r,
                "hits@50": self.hits50 / r, "auc": self.auc_sum / r, "mean_rank": self.rank_sum / r}


class BucketAbandoned(RuntimeError):
    """The bucket in training was given up (``BatchContext.stop``): its tables hold part of its update and must
    not be written; the scheduler gives its locks back unwritten (``LockServerScheduler.abandon``)."""


@dataclass
class BatchContext:
    """What a batch needs besides its edges; built once per bucket."""

    config: ConfigSchema
    model: Model
    relation_optimizer: Optional[RelationAdagrad]
    lhs_tables: dict[int, Table]  # relation index -> table of its lhs entity type in this bucket
    rhs_tables: dict[int, Table]
    num_batch_negs: int
    num_uniform_negs: int
    # which kernels the step runs: the trainer's (its Collaborators'), handed to every Hogwild worker at start;
    # evaluation and the report score with the defaults
    options: KernelOptions = DEFAULT_KERNEL_OPTIONS
    # the learning-rate schedule's factor on ``lr`` for this bucket (job/train/lr_schedule.py); handed to Hogwild
    # workers with each task, since the config they took at start holds the undecayed rate
    lr_scale: float = 1.0
    # polled between batches (``process_edges``): True gives the bucket up (``BucketAbandoned``). A distributed
    # trainer's round may end while its bucket cannot finish in time (``LockServerScheduler.stop_check``)
    stop: Optional[Callable[[], bool]] = None

    @property
    def entity_lr(self) -> float:
        """The embeddings' learning rate for this bucket: ``lr`` times the schedule's factor."""
        return self.config.lr * self.lr_scale


def _sample_uniform(ctx: BatchContext, num_pos: int, num_uniform: int, count: int, disabled: bool,
                    generator: Optional[torch.Generator], on_host: bool = False) -> Optional[Tensor]:
    """``num_uniform`` entity ids per chunk of positives (PBG draws a fresh sample for every chunk); ``on_host``:
    left in host memory (a replayed graph copies them straight into its inputs)."""
    if disabled or num_uniform == 0 or count == 0:
        return None
    chunk = ctx.num_batch_negs if ctx.num_batch_negs > 0 else num_uniform
    num_chunks = (num_pos + chunk - 1) // chunk
    device = next(iter(ctx.lhs_tables.values())).weight.device
    # drawn by the CPU generator on every device: a seeded run samples the same negatives on CPU and CUDA
    ids = torch.randint(0, count, (num_chunks, num_uniform), generator=generator)
    return ids if device.type == "cpu" or on_host else ids.to(device, non_blocking=True)


def draw_negatives(ctx: BatchContext, rel_idx: int, num_pos: int, generator: Optional[torch.Generator],
                   on_host: bool = False) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """A batch's uniform negatives (lhs, rhs), each (chunks x num_uniform_negs) or None; ``on_host``: see
    ``_sample_uniform``."""
    config = ctx.config
    num_uniform = 0 if config.relations[rel_idx].all_negs else ctx.num_uniform_negs
    lhs_count = ctx.lhs_tables[rel_idx].weight.shape[0]
    rhs_count = ctx.rhs_tables[rel_idx].weight.shape[0]
    return (_sample_uniform(ctx, num_pos, num_uniform, lhs_count, config.disable_lhs_negs, generator, on_host),
            _sample_uniform(ctx, num_pos, num_uniform, rhs_count, config.disable_rhs_negs, generator, on_host))


def _update_rows(ctx: BatchContext, rows: SelectedRows, lhs_table: Table, rhs_table: Table, lhs_rows: Tensor,
                 rhs_rows: Tensor, shared_storage: bool) -> None:
    """The row-wise Adagrad steps of a trained batch, then the relation parameters' step."""
    lr = ctx.entity_lr
    if rows.static and lhs_table.weight.device.type == "cpu" and not ctx.options.static_shapes_on_cpu:
        if shared_storage:
            row_adagrad_occurrences(lhs_table, [(rows.lhs_uniq, lhs_rows.grad), (rows.rhs_uniq, rhs_rows.grad)], lr)
        else:
            row_adagrad_occurrences(lhs_table, [(rows.lhs_uniq, lhs_rows.grad)], lr)
            row_adagrad_occurrences(rhs_table, [(rows.rhs_uniq, rhs_rows.grad)], lr)
    elif rows.static:
        if shared_storage:
            row_adagrad_repeated(lhs_table, torch.cat((rows.lhs_uniq, rows.rhs_uniq)), cat_grads(lhs_rows, rhs_rows), lr)
        else:
            row_adagrad_repeated(lhs_table, rows.lhs_uniq, lhs_rows.grad, lr)
            row_adagrad_repeated(rhs_table, rows.rhs_uniq, rhs_rows.grad, lr)
    elif shared_storage and not rows.same_table and lhs_rows.grad is not None and rhs_rows.grad is not None:
        # One Adagrad step per row, as with a merged sparse gradient: a row on both sides (rare in a
        # large table) gets its rhs gradient added to its lhs one and a zero rhs gradient, which
        # leaves it untouched by the rhs step. Cheaper than gathering both sides into a union.
        in_lhs, in_rhs = overlap(rows.lhs_uniq, rows.rhs_uniq, lhs_table.weight.shape[0])
        if in_rhs.numel():
            lhs_rows.grad.index_add_(0, in_lhs, rhs_rows.grad.index_select(0, in_rhs))
            rhs_rows.grad.index_fill_(0, in_rhs, 0.0)
        row_adagrad(lhs_table, rows.lhs_uniq, lhs_rows.grad, lr)
        row_adagrad(rhs_table, rows.rhs_uniq, rhs_rows.grad, lr)
    else:
        row_adagrad(lhs_table, rows.lhs_uniq, lhs_rows.grad, lr)
        if not rows.same_table:
            row_adagrad(rhs_table, rows.rhs_uniq, rhs_rows.grad, lr)
    if ctx.relation_optimizer is not None:
        ctx.relation_optimizer.step()


def run_batch(
    ctx: BatchContext,
    rel_idx: int,
    lhs_ids: Tensor,
    rhs_ids: Tensor,
    rel_ids: Optional[Tensor],
    *,
    generator: Optional[torch.Generator],
    train: bool,
    lhs_features: Optional[tuple[Tensor, Tensor]] = None,
    rhs_features: Optional[tuple[Tensor, Tensor]] = None,
    negatives: Optional[tuple[Optional[Tensor], Optional[Tensor]]] = None,
) -> BatchStats:
    """Train on (or evaluate) one batch of edges of relation ``rel_idx`` (or of dynamic relations ``rel_ids``).

    ``negatives``: the uniform negatives as ``draw_negatives`` returns them, when the caller drew them
    (a captured CUDA graph reads them from fixed buffers); otherwise drawn here from ``generator``.
    """
    config = ctx.config
    relation = config.relations[rel_idx]
    lhs_table = ctx.lhs_tables[rel_idx]
    rhs_table = ctx.rhs_tables[rel_idx]
    if config.entities[relation.lhs].featurized or config.entities[relation.rhs].featurized:
        return _run_featurized_batch(ctx, rel_idx, lhs_ids, rhs_ids=rhs_ids, rel_ids=rel_ids, generator=generator,
                                     train=train, lhs_features=lhs_features,
                                     rhs_features=rhs_features)
    shared_storage = lhs_table.weight.data_ptr() == rhs_table.weight.data_ptr()
    num_pos = int(lhs_ids.shape[0])
    # One gather for both sides pays when they touch mostly the same rows (small tables). On large tables
    # each side gathers its own rows, so the operator and the comparator's preparation run only on the
    # rows that side needs; the two gradients are merged before the one Adagrad update per row.
    same_table = shared_storage and (relation.all_negs or lhs_table.weight.shape[0] <= JOINT_GATHER_ROWS_PER_EDGE * num_pos)
    lhs_neg, rhs_neg = negatives if negatives is not None else draw_negatives(ctx, rel_idx, num_pos, generator)
    options = ctx.options
    static = train and not relation.all_negs and (lhs_table.weight.device.type != "cpu" or options.static_shapes_on_cpu)
    static = static or (options.occurrences_on_cpu and occurrences_pay(lhs_table, same_table, relation.all_negs, train))
    rows = select_rows(lhs_ids, rhs_ids, lhs_neg, rhs_neg=rhs_neg, lhs_table=lhs_table, rhs_table=rhs_table,
                       same_table=same_table, all_negs=relation.all_negs,
                       static=static)
    if config.max_norm is not None and train:
        # a table without optimizer state is read-only (a frozen entity type): not even renormalised
        if lhs_table.optim_sum is not None:
            renorm_rows(lhs_table.weight, rows.lhs_uniq, config.max_norm)
        if not rows.same_table and rhs_table.optim_sum is not None:
            renorm_rows(rhs_table.weight, rows.rhs_uniq, config.max_norm)
    with torch.set_grad_enabled(train):
        lhs_rows = lhs_table.weight.index_select(0, rows.lhs_uniq)
        if train:
            lhs_rows.requires_grad_(True)
        if rows.same_table:
            rhs_rows = lhs_rows
        else:
            rhs_rows = rhs_table.weight.index_select(0, rows.rhs_uniq)
            if train:
                rhs_rows.requires_grad_(True)
        lhs_scores, rhs_scores = ctx.model.score_batch(
            rel_idx, rel_ids,
            lhs=Side(lhs_rows, rows.lhs_inv, rows.lhs_neg_inv, config.disable_lhs_negs),
            rhs=Side(rhs_rows, rows.rhs_inv, rows.rhs_neg_inv, config.disable_rhs_negs),
            num_batch_negs=ctx.num_batch_negs, all_negs=relation.all_negs, options=options,
            dropout=config.embedding_dropout if train else 0.0,
        )
        stats = _finish(ctx, rel_idx, rel_ids, num_pos, train, lhs=lhs_scores, rhs=rhs_scores)
    if train:
        _update_rows(ctx, rows, lhs_table, rhs_table, lhs_rows, rhs_rows, shared_storage)
    return stats


def _finish(ctx: BatchContext, rel_idx: int, rel_ids: Optional[Tensor], num_pos: int, train: bool, *,
            lhs: SideScores, rhs: SideScores) -> BatchStats:
    """Loss (and its backward) plus statistics, shared by plain and featurized batches; ``lhs`` / ``rhs``: each
    side's scores as ``Model.score_batch`` returns them."""
    config = ctx.config
    relation = config.relations[rel_idx]
    stats = BatchStats(count=num_pos)
    if train:
        loss = relation.weight * (_side_loss(config, lhs) + _side_loss(config, rhs))
        total = loss
        if config.regularization_coef > 0:
            assert lhs.raw is not None and rhs.raw is not None  # score_batch sets them
            reg = config.regularization_coef * _penalty(ctx.model, config.regularizer, rel_idx, rel_ids, lhs.raw,
                                                        rhs.raw, num_pos)
            total = total + reg
            stats.reg = _statistic(reg)
        total.backward()
        for side_scores in (lhs, rhs):
            if side_scores.deferred is not None:
                side_scores.deferred.merge()
        stats.loss = _statistic(loss)
    with torch.no_grad():
        for side_scores, name in ((lhs, "lhs"), (rhs, "rhs")):
            if side_scores.violators is not None:
                setattr(stats, f"violators_{name}", _statistic(side_scores.violators))
                continue
            if side_scores.neg.shape[1] == 0:
                continue
            above = side_scores.neg > side_scores.pos.unsqueeze(1)
            setattr(stats, f"violators_{name}",
                    _statistic((above * side_scores.weight).sum() if side_scores.weight is not None else above.sum()))
            if not train:
                _add_ranks(stats, side_scores)
    return stats


def _featurized_side(
    ctx: BatchContext, side: str, ids: Tensor, features: Optional[tuple[Tensor, Tensor]], table: Table,
    entity_type: str, generator: Optional[torch.Generator], train: bool,
) -> tuple[tuple[Tensor, Tensor, Optional[Tensor]], tuple[Table, Tensor, Tensor]]:
    """One side of a featurized batch: ((rows, positives' positions, negatives' positions), (table, unique
    rows, the leaf their gradient reaches))."""
    config = ctx.config
    num_pos = int(ids.shape[0])
    if config.entities[entity_type].featurized:
        if features is None:
            raise ValueError(f"entity type {entity_type} is featurized but the edges carry no {side}d feature lists")
        device = table.weight.device
        offsets, data = features[0].to(device), features[1].to(device)
        uniq, inverse = torch.unique(data, return_inverse=True)
        if config.max_norm is not None and train and table.optim_sum is not None:
            renorm_rows(table.weight, uniq, config.max_norm)
        leaf = table.weight.index_select(0, uniq)
        if train:
            leaf.requires_grad_(True)
        with torch.set_grad_enabled(train):
            rows = F.embedding_bag(inverse, leaf, offsets[:-1], mode="mean")
        return (rows, torch.arange(num_pos, device=device), None), (table, uniq, leaf)
    disabled = config.disable_lhs_negs if side == "lhs" else config.disable_rhs_negs
    neg = _sample_uniform(ctx, num_pos, ctx.num_uniform_negs, table.weight.shape[0], disabled, generator)
    joined = ids if neg is None else torch.cat((ids, neg.reshape(-1)))
    uniq, inverse = torch.unique(joined, return_inverse=True)
    leaf = table.weight.index_select(0, uniq)
    if train:
        leaf.requires_grad_(True)
    return (leaf, inverse[:num_pos], None if neg is None else inverse[num_pos:].view_as(neg)), (table, uniq, leaf)


def _run_featurized_batch(
    ctx: BatchContext,
    rel_idx: int,
    lhs_ids: Tensor,
    *,
    rhs_ids: Tensor,
    rel_ids: Optional[Tensor],
    generator: Optional[torch.Generator],
    train: bool,
    lhs_features: Optional[tuple[Tensor, Tensor]],
    rhs_features: Optional[tuple[Tensor, Tensor]],
) -> BatchStats:
    """A batch where a side's entities are bags of features (mean of their feature embeddings, as PBG).

    A featurized side has no uniform negatives (PBG cannot sample bags either) and is scored
    per edge rather than per unique row; its gradients reach the unique feature rows.
    """
    config = ctx.config
    relation = config.relations[rel_idx]
    num_pos = int(lhs_ids.shape[0])
    sides = {}
    leaves: list[tuple[Table, Tensor, Tensor]] = []
    for side, ids, features, table, entity_type in (
        ("lhs", lhs_ids, lhs_features, ctx.lhs_tables[rel_idx], relation.lhs),
        ("rhs", rhs_ids, rhs_features, ctx.rhs_tables[rel_idx], relation.rhs),
    ):
        sides[side], touched = _featurized_side(ctx, side, ids, features, table, entity_type, generator, train)
        leaves.append(touched)
    with torch.set_grad_enabled(train):
        lhs_rows, lhs_inv, lhs_neg_inv = sides["lhs"]
        rhs_rows, rhs_inv, rhs_neg_inv = sides["rhs"]
        lhs_scores, rhs_scores = ctx.model.score_batch(
            rel_idx, rel_ids,
            lhs=Side(lhs_rows, lhs_inv, lhs_neg_inv, config.disable_lhs_negs),
            rhs=Side(rhs_rows, rhs_inv, rhs_neg_inv, config.disable_rhs_negs),
            num_batch_negs=ctx.num_batch_negs, all_negs=False, options=ctx.options,
            dropout=config.embedding_dropout if train else 0.0,
        )
        stats = _finish(ctx, rel_idx, rel_ids, num_pos, train, lhs=lhs_scores, rhs=rhs_scores)
    if train:
        (lhs_table, lhs_uniq, lhs_leaf), (rhs_table, rhs_uniq, rhs_leaf) = leaves
        if lhs_table.weight.data_ptr() == rhs_table.weight.data_ptr():
            # one entity type on both sides: one Adagrad step per feature row with both sides' gradients
            # summed, as PBG's RowAdagrad steps the one shared parameter once (torchbiggraph/train.py,
            # Trainer.process_one_batch: one backward, then one step per entity optimizer)
            row_adagrad_repeated(lhs_table, torch.cat((lhs_uniq, rhs_uniq)), cat_grads(lhs_leaf, rhs_leaf), ctx.entity_lr)
        else:
            row_adagrad(lhs_table, lhs_uniq, lhs_leaf.grad, ctx.entity_lr)
            row_adagrad(rhs_table, rhs_uniq, rhs_leaf.grad, ctx.entity_lr)
        if ctx.relation_optimizer is not None:
            ctx.relation_optimizer.step()
    return stats


def _side_loss(config: ConfigSchema, scores: SideScores) -> Tensor:
    if scores.loss is not None:
        return scores.loss
    if config.label_smoothing > 0 and config.loss_fn == "softmax" and scores.neg.shape[1] > 0:
        # 1-vs-all only (the config refuses sampled negatives with it), so no column weights
        return smoothed_softmax_loss(scores.pos, scores.neg, config.label_smoothing)
    return compute_loss(config.loss_fn, config.margin, scores.pos, scores.neg, scores.weight, scores.num_neg)


def _statistic(value: Tensor | float) -> Tensor | float:
    """A per-batch sum: a Python number on the CPU; on a GPU the 0-dim tensor itself, which the bucket's
    totals read once (``BatchStats.training_metrics``): converting it here would wait for the GPU every batch."""
    if isinstance(value, Tensor):
        return float(value.detach()) if value.device.type == "cpu" else value.detach()
    return value


def _penalty(model: Model, kind: str, rel_idx: int, rel_ids: Optional[Tensor], lhs_raw: Tensor, rhs_raw: Tensor,
             num_pos: int) -> Tensor:
    """The ``regularizer`` sum of a batch (before ``regularization_coef``), from its positives' raw rows."""
    if kind == "DURA":
        lhs_operator = model.lhs_operators[rel_idx]
        rhs_operator = model.rhs_operators[rel_idx]
        assert isinstance(lhs_operator, Operator) and isinstance(rhs_operator, Operator)
        # the lhs operator makes queries only when scoring is reciprocal (else it is PBG's absent one)
        return dura_penalty(rhs_operator, lhs_operator if model.reciprocal else None, rel_ids, lhs_raw, rhs_raw)
    return n3_penalty(_operators(model, rel_idx), rel_ids, lhs_raw, rhs_raw, num_pos, kind)


def _operators(model: Model, rel_idx: int) -> list[Operator]:
    """The relation's operators a batch goes through (the lhs one is parameterless unless reciprocal)."""
    return [op for op in (model.rhs_operators[rel_idx], model.lhs_operators[rel_idx]) if isinstance(op, Operator)]


def _add_ranks(stats: BatchStats, scores: SideScores) -> None:
    """Ranks as PBG counts them: 1 + negatives scoring at least the positive (ties count against)."""
    pos = scores.pos.unsqueeze(1)
    neg = scores.neg
    valid = (neg > -1e8).to(neg.dtype)  # masked entries are not candidates
    if scores.weight is not None:
        valid = valid * scores.weight  # a candidate drawn k times counts k times
    ranks = ((neg >= pos) * valid).sum(1) + 1
    num_valid = valid.sum(1).clamp_min(1)
    below = ((neg < pos) * valid).sum(1) + 0.5 * ((neg == pos) * valid).sum(1)
    stats.rank_sum += float(ranks.sum())
    stats.reciprocal_rank_sum += float(ranks.float().reciprocal().sum())
    stats.hits1 += float((ranks <= 1).sum())
    stats.hits10 += float((ranks <= 10).sum())
    stats.hits50 += float((ranks <= 50).sum())
    stats.auc_sum += float((below / num_valid).sum())
    stats.num_ranks += int(ranks.shape[0])
