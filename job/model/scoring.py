"""PBG's scoring model: relation operators and global embeddings, and the scores of a batch with its negatives.

The mathematics is PBG's (``torchbiggraph/model.py``): an edge (u, r, v) scores
``c(u, f_r(v))``, with the operator on the right-hand side only; with dynamic relations
both sides have an operator copy and each side's negatives are scored against the
other side's transformed positive. Negatives come from the positives of the same
chunk (``num_batch_negs`` per chunk) plus ``num_uniform_negs`` entities sampled per
chunk from the partition, or every entity of the partition (``all_negs``).

What differs is how the work is laid out, because that is where PBG spends its time:

- Each embedding table is gathered once per batch over the *unique* row ids it is
  touched by (positives and sampled negatives together); global embeddings, operators
  and comparator preparation are applied once per unique row, never per (chunk,
  negative) copy. Gradients arrive dense on those unique rows, so the row-wise
  Adagrad update is one ``index_add_`` per table.
- When a side's unique candidate rows are fewer than the negatives per chunk (small
  entity vocabularies such as the demo graphs), negative scores are computed against
  the unique rows with one matrix product and then gathered, instead of materialising
  a (chunks x negatives x dim) tensor.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from job.config import ConfigSchema
from job.errors import CheckpointError
from job.model import fused_all
from job.model.comparators import Comparator
from job.model.deferred import DeferredRows, gather_positives
from job.model.fused import ScoringSetup, SideResult, fused_side, fused_supported
from job.model.fused_pair import adjoint_applies, fused_pair, fused_pair_adjoint
from job.model.kernel_options import DEFAULT_KERNEL_OPTIONS, KernelOptions
from job.model.operators import Operator
from job.model.operators import rows as _rows
from job.model.side import Side

MASKED_SCORE = -1e9


@dataclass
class Table:
    """One embedding table taking part in a batch: a partition's rows and its row-wise Adagrad sums."""

    weight: Tensor  # (count, dim), shared memory during training
    # (count,); None makes the rows read-only: evaluation, and the training view of a frozen entity type
    optim_sum: Optional[Tensor]


@dataclass
class SideScores:
    pos: Tensor  # (B,)
    neg: Tensor  # (B, K) with masked entries at MASKED_SCORE
    # how many times each column counts (None: once); masked entries weigh 0
    weight: Optional[Tensor] = None
    num_neg: Optional[int] = None  # negatives per positive as sampled (the width of the unweighted view)
    loss: Optional[Tensor] = None  # already computed (with its gradients attached) by job.model.fused
    violators: Optional[Tensor | float] = None  # already counted by job.model.fused (then ``neg`` holds no scores)
    # this side's positives gathered off autograd: merge their gradient after backward (job.model.deferred)
    deferred: Optional[DeferredRows] = None
    # this side's positive embeddings before any operator, one row per edge (the regulariser's input); set by
    # ``Model.score_batch`` (without a regulariser: the side's rows, unused)
    raw: Optional[Tensor] = None


class Model(nn.Module):
    """Relation operators and global embeddings (the shared parameters of model.h5)."""

    def __init__(self, config: ConfigSchema, num_dynamic_rels: int = 0) -> None:
        super().__init__()
        self.config = config
        self.dim = config.dimension
        self.num_dynamic_rels = num_dynamic_rels
        # Reciprocal scoring: each side's candidates are ranked against a query its own operator copy makes from
        # the other side, c(u', h_r(v)) and c(g_r(u), v'). Dynamic relations always score so (PBG); static ones
        # with ``reciprocal_relations``, g_r being the relation read forwards and h_r its inverse relation type.
        self.reciprocal = num_dynamic_rels > 0 or config.reciprocal_relations
        self.lhs_operators = nn.ModuleList()
        self.rhs_operators = nn.ModuleList()
        for relation in config.relations:
            self.rhs_operators.append(Operator(relation.operator, self.dim, num_dynamic_rels))
            # PBG keeps no lhs operator for static relations; a parameterless one keeps indexing simple.
            self.lhs_operators.append(
                Operator(relation.operator if self.reciprocal else "none", self.dim, num_dynamic_rels))
        self.global_embs = nn.ParameterDict()
        if config.global_emb:
            for entity_type in config.entities:
                self.global_embs[f"emb_{entity_type}"] = nn.Parameter(torch.zeros(self.dim))
        self.comparator = Comparator(config.comparator, config.bias)
        # hand-differentiated negative scoring (job.model.fused) where the comparator is a plain dot product
        self.fused = fused_supported(config.comparator, config.bias, config.loss_fn)
        # the dtype of the training step's scores and products (the Trainer sets it from compute_dtype);
        # None: the embeddings' own. Evaluation always scores in the embeddings' dtype.
        self.compute_dtype: Optional[torch.dtype] = None

    # state dict in PBG's naming ------------------------------------------------------------
    def public_state_dict(self) -> dict[str, tuple[str, Tensor]]:
        """{public name: (private name, tensor)} exactly as PBG's model.h5 holds them."""
        out: dict[str, tuple[str, Tensor]] = {}
        for side, operators in (("lhs", self.lhs_operators), ("rhs", self.rhs_operators)):
            for idx, operator in enumerate(operators):
                if not isinstance(operator, Operator):  # ModuleList items are typed as plain Modules
                    raise TypeError(f"{side}_operators.{idx} is a {type(operator).__name__}, not an Operator")
                for name in operator.param_names:
                    out[f"relations/{idx}/operator/{side}/{name}"] = (
                        f"{side}_operators.{idx}.{name}",
                        getattr(operator, name).detach(),
                    )
        for key, param in self.global_embs.items():
            entity_type = key[len("emb_") :]
            out[f"entities/{entity_type}/global_embedding"] = (f"global_embs.{key}", param.detach())
        return out

    def load_public_state_dict(self, params: Mapping[str, "torch.Tensor | object"], where: str) -> None:
        """Copy parameters in place (keeps shared memory valid) from public names; unknown names are errors."""
        own = self.public_state_dict()
        for name, value in params.items():
            if name not in own:
                raise CheckpointError(f"{where}: unexpected model parameter 'model/{name}' for this config")
            target = own[name][1]
            tensor = torch.as_tensor(value)
            if tuple(tensor.shape) != tuple(target.shape):
                raise CheckpointError(
                    f"{where}: model parameter 'model/{name}' has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(target.shape)} for this config"
                )
            with torch.no_grad():
                target.copy_(tensor)

    def global_emb(self, entity_type: str) -> Optional[Tensor]:
        return self.global_embs[f"emb_{entity_type}"] if f"emb_{entity_type}" in self.global_embs else None

    # scoring -----------------------------------------------------------------------------------
    def score_batch(
        self,
        rel_idx: int,
        rel: Optional[Tensor],
        *,
        lhs: Side,
        rhs: Side,
        num_batch_negs: int,
        all_negs: bool,
        options: KernelOptions = DEFAULT_KERNEL_OPTIONS,
        dropout: float = 0.0,
    ) -> tuple[SideScores, SideScores]:
        """Scores of one batch of a single relation (or of dynamic relations ``rel``): (lhs side, rhs side), each
        with its positives' raw embeddings in ``raw`` (for the regulariser).

        ``lhs`` / ``rhs``: each side's gathered rows (the same tensor when both sides share one gather) with
        their positives' and uniform negatives' positions. With ``all_negs`` the rows must be the whole partition
        in id order (so ``inv`` are the entity ids). ``options``: which kernels score it (the trainer's; evaluation
        takes the defaults). ``dropout``: ``embedding_dropout`` on each query's entity row and relation parameters
        (reciprocal scoring only; the trainer passes it for training batches, every other caller leaves it 0).
        """
        relation = self.config.relations[rel_idx]
        lhs_base = self._with_global(lhs.rows, relation.lhs)
        rhs_base = lhs_base if rhs.rows is lhs.rows else self._with_global(rhs.rows, relation.rhs)
        if lhs_base is not lhs.rows:  # a global embedding was added (without one, the sides as given)
            lhs = lhs.with_rows(lhs_base)
        if rhs_base is not rhs.rows:
            rhs = rhs.with_rows(rhs_base)
        batch = _Batch(rel_idx, rel, lhs, rhs, num_batch_negs, all_negs, options, dropout)
        if self.reciprocal:
            return self._score_reciprocal(batch)
        return self._score_static(batch)

    def _with_global(self, rows: Tensor, entity_type: str) -> Tensor:
        g = self.global_emb(entity_type)
        return rows if g is None else rows + g

    def _score_reciprocal(self, batch: _Batch) -> tuple[SideScores, SideScores]:
        """Each side's negatives against the other side's positive transformed by that side's operator.

        Only the query side goes through an operator, so the candidates of both sides are the plain prepared
        rows (with ``all_negs``: the whole table once), which is what makes 1-vs-all training cheap.
        """
        comparator = self.comparator
        lhs, rhs = batch.lhs, batch.rhs
        lhs_prepared = comparator.prepare(lhs.rows)
        rhs_prepared = comparator.prepare(rhs.rows)
        defer = batch.options.deferred_positives
        lhs_pos_raw, lhs_deferred = gather_positives(lhs.rows, lhs.inv, defer)
        rhs_pos_raw, rhs_deferred = gather_positives(rhs.rows, rhs.inv, defer)
        # "forward": c(u, h_r(v)) against lhs negatives u' (positives gathered from candidates[own])
        rhs_pos_transformed = comparator.prepare(self._query(self.rhs_operators[batch.rel_idx], rhs_pos_raw, batch))
        if (batch.all_negs and torch.is_grad_enabled() and batch.options.fused_all_negs
                and fused_all.applies(comparator.kind, comparator.bias, self.config.loss_fn)):
            lhs_pos_transformed = comparator.prepare(self._query(self.lhs_operators[batch.rel_idx], lhs_pos_raw, batch))
            lhs_scores, rhs_scores = self._all_negs_pair(batch, lhs_prepared, rhs_prepared, rhs_pos_transformed,
                                                         lhs_pos_transformed)
        else:
            lhs_scores = self._side_scores(batch, lhs, anchor=rhs_pos_transformed, positives=None,
                                           candidates=lhs_prepared)
            # "reverse": c(g_r(u), v) against rhs negatives v'
            lhs_pos_transformed = comparator.prepare(self._query(self.lhs_operators[batch.rel_idx], lhs_pos_raw, batch))
            rhs_scores = self._side_scores(batch, rhs, anchor=lhs_pos_transformed, positives=None,
                                           candidates=rhs_prepared)
        lhs_scores.deferred, rhs_scores.deferred = lhs_deferred, rhs_deferred
        lhs_scores.raw, rhs_scores.raw = lhs_pos_raw, rhs_pos_raw
        return lhs_scores, rhs_scores

    @staticmethod
    def _query(operator: nn.Module, rows: Tensor, batch: _Batch) -> Tensor:
        """The queries one side's positive ``rows`` make through ``operator`` (reciprocal scoring).

        With ``embedding_dropout`` (``batch.dropout`` > 0, training only) each query's entity row and its own
        copy of the relation parameters are dropped out independently, as LibKGE trains ComplEx (its query
        (s, p) embeds s and p with dropout; ``Operator.forward_dropped``). The candidates and the rows the
        regulariser reads (``raw``) stay whole.
        """
        assert isinstance(operator, Operator)
        if batch.dropout <= 0:
            return operator(rows, batch.rel)
        return operator.forward_dropped(F.dropout(rows, batch.dropout), batch.rel, batch.dropout)

    def _score_static(self, batch: _Batch) -> tuple[SideScores, SideScores]:
        """c(u, f_r(v)): the operator on the right-hand side only; the lhs side never has one on its negatives."""
        operator = self.rhs_operators[batch.rel_idx]
        assert isinstance(operator, Operator)
        lhs, rhs = batch.lhs, batch.rhs
        fused = self._use_fused(batch.all_negs) and lhs.inv.shape[0] > 0
        if fused and batch.options.operator_adjoint and adjoint_applies(self.comparator.kind, operator):
            # dot: f_r's adjoint on the anchors, the rhs rows unprepared (job.model.fused_pair)
            loss, lhs_result, rhs_result = fused_pair_adjoint(self._scoring_setup(batch), operator, lhs=lhs, rhs=rhs)
            lhs_scores = _side_scores_of(lhs_result, loss)
            rhs_scores = _side_scores_of(rhs_result, loss.new_zeros(()))
            return self._static_result(batch, lhs_scores, rhs_scores)
        lhs_prepared = self.comparator.prepare(lhs.rows)
        rhs_prepared = self.comparator.prepare(operator(rhs.rows))
        if fused:
            loss, lhs_result, rhs_result = fused_pair(self._scoring_setup(batch), lhs=lhs.with_rows(lhs_prepared),
                                                      rhs=rhs.with_rows(rhs_prepared))
            lhs_scores = _side_scores_of(lhs_result, loss)
            rhs_scores = _side_scores_of(rhs_result, loss.new_zeros(()))
        else:
            lhs_pos_vec = _rows(lhs_prepared, lhs.inv)
            rhs_pos_vec = _rows(rhs_prepared, rhs.inv)
            lhs_scores = self._side_scores(batch, lhs, anchor=rhs_pos_vec, positives=lhs_pos_vec,
                                           candidates=lhs_prepared)
            rhs_scores = self._side_scores(batch, rhs, anchor=lhs_pos_vec, positives=rhs_pos_vec,
                                           candidates=rhs_prepared)
        return self._static_result(batch, lhs_scores, rhs_scores)

    def _all_negs_pair(self, batch: _Batch, lhs_candidates: Tensor, rhs_candidates: Tensor, lhs_queries: Tensor,
                       rhs_queries: Tensor) -> tuple[SideScores, SideScores]:
        """Both sides of a reciprocal 1-vs-all softmax batch (``job.model.fused_all``): ``lhs_queries`` rank
        ``lhs_candidates`` for the lhs targets, ``rhs_queries`` the rhs ones; stacked into one set of products
        when both sides rank the same table."""
        lhs, rhs = batch.lhs, batch.rhs
        num_pos = lhs.inv.shape[0]
        sides = [(lhs_candidates, lhs_queries, lhs.inv, lhs.negs_disabled),
                 (rhs_candidates, rhs_queries, rhs.inv, rhs.negs_disabled)]
        live = [side for side in sides if not side[3] and num_pos > 0]
        zero = lhs_queries.new_zeros(())
        losses: list[Tensor] = [zero, zero]
        violators: list[Tensor | float] = [0.0, 0.0]
        if len(live) == 2 and lhs_candidates is rhs_candidates:
            loss, counts = fused_all.softmax_all(torch.cat((lhs_queries, rhs_queries)), lhs_candidates,
                                                 torch.cat((lhs.inv, rhs.inv)), self.compute_dtype,
                                                 (num_pos, num_pos), self.config.label_smoothing)
            losses[0], violators = loss, [counts[0], counts[1]]
        else:
            for index, (candidates, queries, targets, disabled) in enumerate(sides):
                if not disabled and num_pos > 0:
                    losses[index], counts = fused_all.softmax_all(queries, candidates, targets, self.compute_dtype,
                                                                  label_smoothing=self.config.label_smoothing)
                    violators[index] = counts[0]
        empty = lhs_queries.new_empty((num_pos, 0))
        pos = lhs_queries.new_zeros(num_pos)  # not needed: the loss and the violators are already counted
        return tuple(SideScores(pos, empty, num_neg=candidates.shape[0], loss=loss, violators=count)  # type: ignore[return-value]
                     for (candidates, *_), loss, count in zip(sides, losses, violators))

    def _static_result(self, batch: _Batch, lhs_scores: SideScores,
                       rhs_scores: SideScores) -> tuple[SideScores, SideScores]:
        """The scores with each side's raw positives (``raw``): gathered only when the regulariser reads them."""
        lhs, rhs = batch.lhs, batch.rhs
        if self.config.regularization_coef > 0:  # only the regulariser needs the raw positive embeddings
            lhs_scores.raw, rhs_scores.raw = _rows(lhs.rows, lhs.inv), _rows(rhs.rows, rhs.inv)
        else:
            lhs_scores.raw, rhs_scores.raw = lhs.rows, rhs.rows
        return lhs_scores, rhs_scores

    def _use_fused(self, all_negs: bool) -> bool:
        return self.fused and not all_negs and torch.is_grad_enabled()

    def _scoring_setup(self, batch: _Batch) -> ScoringSetup:
        return ScoringSetup(self.config.loss_fn, self.config.margin, batch.num_batch_negs, MASKED_SCORE,
                            batch.options.native_loss, self.compute_dtype)

    def _products_dtype(self) -> Optional[torch.dtype]:
        """The reduced precision of the autograd path's products: training only (ranks need exact ties)."""
        return self.compute_dtype if torch.is_grad_enabled() else None

    def _side_scores(self, batch: _Batch, side: Side, *, anchor: Tensor, positives: Optional[Tensor],
                     candidates: Tensor) -> SideScores:
        """Positive scores and negatives for corrupting one side, ``side`` (its positions and negatives switch).

        ``anchor`` holds the other side's prepared positive vectors (B x d), ``positives``
        this side's (B x d), ``candidates`` this side's prepared unique rows (U x d).
        """
        num_pos = anchor.shape[0]
        own, neg_inv, disabled = side.inv, side.neg_inv, side.negs_disabled
        if self._use_fused(batch.all_negs) and not disabled and num_pos > 0:
            loss, result = fused_side(self._scoring_setup(batch), anchor, candidates, own, neg_inv)
            return _side_scores_of(result, loss)
        if positives is None:  # the fused path gathers its own; only this one needs them as a tensor
            positives = _rows(candidates, own)
        pos = self.comparator.pos(anchor, positives)
        if disabled or num_pos == 0:
            return SideScores(pos, pos.new_empty((num_pos, 0)))
        if batch.all_negs:
            # every entity of the partition (candidates are the whole table); mask each positive's own column
            scores = self.comparator.pairwise(anchor, candidates, self._products_dtype())  # (B, N)
            return SideScores(pos, scores.scatter(1, own.unsqueeze(1), MASKED_SCORE))
        return self._sampled_negatives(pos, anchor, positives, candidates, neg_inv, batch.num_batch_negs)

    def _sampled_negatives(self, pos: Tensor, anchor: Tensor, positives: Tensor, candidates: Tensor,
                           neg_inv: Optional[Tensor], num_batch_negs: int) -> SideScores:
        """Chunk by chunk: the chunk's other positives (``num_batch_negs``) and its uniform draws ``neg_inv``."""
        comparator = self.comparator
        num_pos = anchor.shape[0]
        parts: list[Tensor] = []
        chunk = num_batch_negs if num_batch_negs > 0 else (neg_inv.shape[1] if neg_inv is not None else num_pos)
        num_chunks = (num_pos + chunk - 1) // chunk
        padded = num_chunks * chunk
        anchor_chunks = _pad_rows(anchor, padded).view(num_chunks, chunk, -1)
        if num_batch_negs > 0:
            pos_chunks = _pad_rows(positives, padded).view(num_chunks, chunk, -1)
            batch_scores = comparator.pairwise(anchor_chunks, pos_chunks, self._products_dtype())  # (C, chunk, chunk)
            batch_scores = batch_scores.masked_fill(_batch_mask(num_chunks, chunk, num_pos, anchor.device), MASKED_SCORE)
            parts.append(batch_scores)
        weight_parts: list[Tensor] = []
        if neg_inv is not None and neg_inv.numel():
            scores, draws = self._uniform_negatives(anchor_chunks, candidates, neg_inv[:num_chunks])
            parts.append(scores)
            if draws is not None:
                weight_parts.append(draws)
        if not parts:
            return SideScores(pos, pos.new_empty((num_pos, 0)))
        neg = torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]
        neg = _first_rows(neg.reshape(padded, -1), num_pos)
        if not weight_parts:
            return SideScores(pos, neg)
        assert neg_inv is not None
        weights = []
        if num_batch_negs > 0:
            weights.append((~_batch_mask(num_chunks, chunk, num_pos, anchor.device)).to(neg.dtype))
        weights.extend(weight_parts)
        weight = _first_rows(torch.cat(weights, dim=2).reshape(padded, -1), num_pos)
        return SideScores(pos, neg, weight, num_neg=(chunk if num_batch_negs > 0 else 0) + neg_inv.shape[1])

    def _uniform_negatives(self, anchor_chunks: Tensor, candidates: Tensor, neg_rows: Tensor
                           ) -> tuple[Tensor, Optional[Tensor]]:
        """Scores (C, chunk, N or U) of each chunk's uniform draws, and how often each column was drawn (or None)."""
        num_chunks, chunk = anchor_chunks.shape[:2]
        if candidates.shape[0] >= neg_rows.shape[1]:
            negatives = _rows(candidates, neg_rows)  # (C, N, d)
            return self.comparator.pairwise(anchor_chunks, negatives, self._products_dtype()), None
        # Fewer distinct candidates than samples (small vocabularies): score each candidate once and
        # weight it by how often it was drawn for the chunk. Every loss and rank is a sum over the
        # sampled negatives, so this is the same sum without a (chunks x samples) tensor.
        all_scores = self.comparator.pairwise(anchor_chunks, candidates.unsqueeze(0), self._products_dtype())  # (C, chunk, U)
        draws = torch.zeros((num_chunks, candidates.shape[0]), dtype=all_scores.dtype, device=all_scores.device)
        draws.scatter_add_(1, neg_rows, torch.ones_like(neg_rows, dtype=draws.dtype))
        return all_scores, draws.unsqueeze(1).expand(num_chunks, chunk, -1)


@dataclass
class _Batch:
    """What ``score_batch`` is given: the relation, each side (its rows with any global embedding added, its
    positives' and negatives' positions), the negatives' setup and the kernel options."""

    rel_idx: int
    rel: Optional[Tensor]
    lhs: Side
    rhs: Side
    num_batch_negs: int
    all_negs: bool
    options: KernelOptions
    dropout: float = 0.0  # embedding_dropout on the query side (training only: the caller passes 0 otherwise)


def _side_scores_of(result: SideResult, loss: Tensor) -> SideScores:
    # the score blocks' memory now holds their gradients: no negative scores, statistics as ``violators``
    return SideScores(result.pos, result.pos.new_empty((result.pos.shape[0], 0)), None, result.num_neg, loss,
                      result.violators)


def _pad_rows(x: Tensor, rows: int) -> Tensor:
    if x.shape[0] == rows:
        return x
    return torch.cat((x, x.new_zeros((rows - x.shape[0],) + tuple(x.shape[1:]))), dim=0)


def _first_rows(x: Tensor, rows: int) -> Tensor:
    """Drop chunk padding; no slice (and no slice in the backward pass) when there is none."""
    return x if x.shape[0] == rows else x[:rows]


_MASK_CACHE: dict[tuple[int, int, int, str], Tensor] = {}


def _batch_mask(num_chunks: int, chunk: int, num_pos: int, device: torch.device) -> Tensor:
    """Which batch-negative scores to ignore: each positive against itself, and padding."""
    key = (num_chunks, chunk, num_pos, str(device))
    mask = _MASK_CACHE.get(key)
    if mask is None:
        eye = torch.eye(chunk, dtype=torch.bool, device=device).expand(num_chunks, chunk, chunk).clone()
        last = num_pos - (num_chunks - 1) * chunk
        if last < chunk:
            eye[-1, :, last:] = True  # padded negatives
        mask = eye
        if len(_MASK_CACHE) > 64:
            _MASK_CACHE.clear()
        _MASK_CACHE[key] = mask
    return mask


def cached_masks() -> list[Tensor]:
    """The masks cached by the scoring functions (what job/train/batch/rowops.py counts as scratch memory)."""
    return list(_MASK_CACHE.values())

