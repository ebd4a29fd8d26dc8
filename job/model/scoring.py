"""PBG's scoring model: relation operators, comparators, losses and negatives.

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

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from job.config import ConfigSchema
from job.train.fused import ScoringSetup, SideResult, fused_pair, fused_side, fused_supported

MASKED_SCORE = -1e9


# Operators ----------------------------------------------------------------------------------


class Operator(nn.Module):
    """A relation operator; ``num_operations`` > 0 makes it dynamic (one set of parameters per relation)."""

    # parameter names match PBG's so that state dicts (and checkpoints) are interchangeable
    def __init__(self, kind: str, dim: int, num_operations: int = 0) -> None:
        super().__init__()
        self.kind = kind
        self.dim = dim
        self.dynamic = num_operations > 0
        suffix = "s" if self.dynamic else ""
        lead = (num_operations,) if self.dynamic else ()
        self.param_names: list[str] = []

        def add(name: str, value: Tensor) -> None:
            self.register_parameter(name + suffix, nn.Parameter(value))
            self.param_names.append(name + suffix)

        if kind == "none":
            pass
        elif kind == "diagonal":
            add("diagonal", torch.ones(lead + (dim,)))
        elif kind == "translation":
            add("translation", torch.zeros(lead + (dim,)))
        elif kind in ("linear", "affine"):
            add("linear_transformation", torch.eye(dim).expand(lead + (dim, dim)).clone())
            if kind == "affine":
                add("translation", torch.zeros(lead + (dim,)))
        elif kind == "complex_diagonal":
            if dim % 2:
                raise ValueError("complex_diagonal needs an even dimension")
            self.real = nn.Parameter(torch.ones(lead + (dim // 2,)))
            self.imag = nn.Parameter(torch.zeros(lead + (dim // 2,)))
            self.param_names += ["real", "imag"]
        else:
            raise ValueError(f"unknown operator {kind}")

    def _get(self, name: str, rel: Optional[Tensor]) -> Tensor:
        param = getattr(self, name + ("s" if self.dynamic else ""))
        return _rows(param, rel) if self.dynamic else param

    def forward(self, x: Tensor, rel: Optional[Tensor] = None) -> Tensor:
        """Apply to rows ``x`` (..., dim); ``rel`` gives the relation of each row when dynamic."""
        kind = self.kind
        if kind == "none":
            return x
        if kind == "diagonal":
            return x * self._get("diagonal", rel)
        if kind == "translation":
            return x + self._get("translation", rel)
        if kind in ("linear", "affine"):
            matrix = self._get("linear_transformation", rel)
            if self.dynamic:
                out = torch.matmul(matrix, x.unsqueeze(-1)).squeeze(-1)
            else:
                out = x @ matrix.t()
            if kind == "affine":
                out = out + self._get("translation", rel)
            return out
        # complex_diagonal: (a + ib)(c + id) with rows laid out as [real | imag]
        real_b = _rows(self.real, rel) if self.dynamic else self.real
        imag_b = _rows(self.imag, rel) if self.dynamic else self.imag
        return _ComplexDiagonal.apply(x, real_b, imag_b)


class _ComplexDiagonal(torch.autograd.Function):
    """Complex multiplication of each row by (real + i imag), differentiated by hand.

    Written into the two halves of one output with fused multiply-adds: autograd's version
    (swap the halves, two broadcast products, a sum) made five full passes forward and more
    backward, and the swap's backward is an index_add; on thousands of rows per batch this was
    the most expensive elementwise step of a batch. ``real``/``imag`` are (h,) for a static
    relation or (rows, h) when each row has its own relation.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, real: Tensor, imag: Tensor) -> Tensor:
        ctx.save_for_backward(x, real, imag)
        half = x.shape[-1] // 2
        x_re, x_im = x[..., :half], x[..., half:]
        out = torch.empty_like(x)
        torch.mul(x_re, real, out=out[..., :half])
        out[..., :half].addcmul_(x_im, imag, value=-1)
        torch.mul(x_re, imag, out=out[..., half:])
        out[..., half:].addcmul_(x_im, real)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], ...]:
        x, real, imag = ctx.saved_tensors
        half = x.shape[-1] // 2
        x_re, x_im = x[..., :half], x[..., half:]
        g_re, g_im = grad[..., :half], grad[..., half:]
        d_x = torch.empty_like(x)
        torch.mul(g_re, real, out=d_x[..., :half])
        d_x[..., :half].addcmul_(g_im, imag)
        torch.mul(g_im, real, out=d_x[..., half:])
        d_x[..., half:].addcmul_(g_re, imag, value=-1)
        # d real = g_re x_re + g_im x_im ; d imag = g_im x_re - g_re x_im, summed over rows for a static relation
        products = (grad * x).view(x.shape[:-1] + (2, half))
        d_imag = g_im * x_re
        d_imag.addcmul_(g_re, x_im, value=-1)
        if real.dim() == 1:
            d_real = products.reshape(-1, 2, half).sum((0, 1))
            d_imag = d_imag.reshape(-1, half).sum(0)
        else:
            d_real = products.sum(-2)
        return d_x, d_real, d_imag


# Comparators --------------------------------------------------------------------------------


class Comparator:
    """Scores pairs of prepared vectors. ``pairwise`` is the batched all-pairs form (C x P x d, C x N x d)."""

    def __init__(self, kind: str, bias: bool) -> None:
        self.kind = kind
        self.bias = bias

    def prepare(self, x: Tensor) -> Tensor:
        if self.bias:
            return torch.cat((x[..., :1], self._prepare(x[..., 1:])), dim=-1)
        return self._prepare(x)

    def _prepare(self, x: Tensor) -> Tensor:
        if self.kind == "cos":
            return x * x.norm(2, dim=-1, keepdim=True).clamp_min(1e-30).reciprocal()
        return x

    def pos(self, x: Tensor, y: Tensor) -> Tensor:
        if self.bias:
            return self._pos(x[..., 1:], y[..., 1:]) + x[..., 0] + y[..., 0]
        return self._pos(x, y)

    def _pos(self, x: Tensor, y: Tensor) -> Tensor:
        if self.kind in ("dot", "cos"):
            return (x * y).sum(-1)
        squared = (x - y).pow(2).sum(-1)
        if self.kind == "squared_l2":
            return -squared
        return -squared.clamp_min(1e-30).sqrt()

    def pairwise(self, x: Tensor, y: Tensor) -> Tensor:
        if self.bias:
            scores = self._pairwise(x[..., 1:], y[..., 1:])
            return scores + x[..., 0].unsqueeze(-1) + y[..., 0].unsqueeze(-2)
        return self._pairwise(x, y)

    def _pairwise(self, x: Tensor, y: Tensor) -> Tensor:
        dots = torch.matmul(x, y.transpose(-1, -2))
        if self.kind in ("dot", "cos"):
            return dots
        squared = (x.pow(2).sum(-1).unsqueeze(-1) + y.pow(2).sum(-1).unsqueeze(-2) - 2 * dots).clamp_min(0)
        if self.kind == "squared_l2":
            return -squared
        return -squared.clamp_min(1e-30).sqrt()


# Losses ---------------------------------------------------------------------------------------


def compute_loss(kind: str, margin: float, pos: Tensor, neg: Tensor, weight: Optional[Tensor] = None,
                 num_neg: Optional[int] = None) -> Tensor:
    """PBG's losses, summed over the batch. ``pos``: (B,), ``neg``: (B, K); ``weight`` counts each column."""
    num_pos, width = neg.shape
    if num_neg is None:
        num_neg = width
    if num_pos == 0 or width == 0:
        if kind == "logistic" and num_pos:
            return F.binary_cross_entropy_with_logits(pos, torch.ones_like(pos), reduction="sum")
        return pos.sum() * 0.0
    if kind == "ranking":
        violation = (margin - pos.unsqueeze(1) + neg).clamp_min(0)
        return (violation * weight).sum() if weight is not None else violation.sum()
    if kind == "logistic":
        pos_loss = F.binary_cross_entropy_with_logits(pos, torch.ones_like(pos), reduction="sum")
        neg_terms = F.softplus(neg)  # = BCE with logits against 0
        neg_loss = (neg_terms * weight).sum() if weight is not None else neg_terms.sum()
        return pos_loss + neg_loss / num_neg
    if kind == "softmax":
        logits = neg if weight is None else neg + weight.log()
        return (torch.logsumexp(torch.cat((pos.unsqueeze(1), logits), dim=1), dim=1) - pos).sum()
    raise ValueError(f"unknown loss {kind}")


# The model ------------------------------------------------------------------------------------


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
    loss: Optional[Tensor] = None  # already computed (with its gradients attached) by job.train.fused
    violators: Optional[Tensor | float] = None  # already counted by job.train.fused (then ``neg`` holds no scores)


class Model(nn.Module):
    """Relation operators and global embeddings (the shared parameters of model.h5)."""

    def __init__(self, config: ConfigSchema, num_dynamic_rels: int = 0) -> None:
        super().__init__()
        self.config = config
        self.dim = config.dimension
        self.num_dynamic_rels = num_dynamic_rels
        dynamic = num_dynamic_rels > 0
        self.lhs_operators = nn.ModuleList()
        self.rhs_operators = nn.ModuleList()
        for relation in config.relations:
            self.rhs_operators.append(Operator(relation.operator, self.dim, num_dynamic_rels))
            # PBG keeps no lhs operator for static relations; a parameterless one keeps indexing simple.
            self.lhs_operators.append(Operator(relation.operator if dynamic else "none", self.dim, num_dynamic_rels))
        self.global_embs = nn.ParameterDict()
        if config.global_emb:
            for entity_type in config.entities:
                self.global_embs[f"emb_{entity_type}"] = nn.Parameter(torch.zeros(self.dim))
        self.comparator = Comparator(config.comparator, config.bias)
        # hand-differentiated negative scoring (job.train.fused) where the comparator is a plain dot product
        self.fused = fused_supported(config.comparator, config.bias, config.loss_fn)

    # state dict in PBG's naming ------------------------------------------------------------
    def public_state_dict(self) -> dict[str, tuple[str, Tensor]]:
        """{public name: (private name, tensor)} exactly as PBG's model.h5 holds them."""
        out: dict[str, tuple[str, Tensor]] = {}
        for side, operators in (("lhs", self.lhs_operators), ("rhs", self.rhs_operators)):
            for idx, operator in enumerate(operators):
                for name in operator.param_names:
                    out[f"relations/{idx}/operator/{side}/{name}"] = (
                        f"{side}_operators.{idx}.{name}",
                        getattr(operator, name).detach(),
                    )
        for key, param in self.global_embs.items():
            entity_type = key[len("emb_") :]
            out[f"entities/{entity_type}/global_embedding"] = (f"global_embs.{key}", param.detach())
        return out

    def load_public_state_dict(self, params: dict[str, "torch.Tensor | object"], where: str) -> None:
        """Copy parameters in place (keeps shared memory valid) from public names; unknown names are errors."""
        from job.errors import CheckpointError

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
        lhs_rows: Tensor,
        rhs_rows: Tensor,
        lhs_type: str,
        rhs_type: str,
        lhs_inv: Tensor,
        rhs_inv: Tensor,
        lhs_neg_inv: Optional[Tensor],
        rhs_neg_inv: Optional[Tensor],
        lhs_same_table: bool,
        num_batch_negs: int,
        all_negs: bool,
        disable_lhs: bool,
        disable_rhs: bool,
    ) -> tuple[SideScores, SideScores, Tensor, Tensor]:
        """Scores of one batch of a single relation (or of dynamic relations ``rel``).

        ``*_rows`` are the gathered unique rows of each side's table (the same tensor when
        both sides share a table); ``*_inv`` index positives into them; ``*_neg_inv``
        (chunks x N) index uniformly sampled negatives. With ``all_negs`` the rows must be the
        whole partition in id order (so ``*_inv`` are the entity ids). Returns per-side scores and the raw positive embeddings
        (for the regulariser).
        """
        comparator = self.comparator
        dynamic = self.num_dynamic_rels > 0
        lhs_base = lhs_rows
        g = self.global_emb(lhs_type)
        if g is not None:
            lhs_base = lhs_base + g
        if lhs_same_table:
            rhs_base = lhs_base
        else:
            rhs_base = rhs_rows
            g = self.global_emb(rhs_type)
            if g is not None:
                rhs_base = rhs_base + g
        lhs_prepared = comparator.prepare(lhs_base)  # lhs side never has an operator on its negatives
        rhs_op = self.rhs_operators[rel_idx]
        lhs_op = self.lhs_operators[rel_idx]
        if dynamic:
            rhs_prepared = comparator.prepare(rhs_base)
            lhs_pos_raw = _rows(lhs_base, lhs_inv)
            rhs_pos_raw = _rows(rhs_base, rhs_inv)
            # "forward": c(u, h_r(v)) against lhs negatives u' (positives gathered from candidates[own])
            rhs_pos_transformed = comparator.prepare(rhs_op(rhs_pos_raw, rel))
            lhs_scores = self._side_scores(
                anchor=rhs_pos_transformed, positives=None, candidates=lhs_prepared,
                neg_inv=lhs_neg_inv, own=lhs_inv, num_batch_negs=num_batch_negs,
                all_negs=all_negs, disabled=disable_lhs,
            )
            # "reverse": c(g_r(u), v) against rhs negatives v'
            lhs_pos_transformed = comparator.prepare(lhs_op(lhs_pos_raw, rel))
            rhs_scores = self._side_scores(
                anchor=lhs_pos_transformed, positives=None, candidates=rhs_prepared,
                neg_inv=rhs_neg_inv, own=rhs_inv, num_batch_negs=num_batch_negs,
                all_negs=all_negs, disabled=disable_rhs,
            )
            return lhs_scores, rhs_scores, lhs_pos_raw, rhs_pos_raw
        rhs_prepared = comparator.prepare(rhs_op(rhs_base))
        num_pos = lhs_inv.shape[0]
        if self._use_fused(all_negs) and num_pos > 0:
            loss, lhs_result, rhs_result = fused_pair(
                self._scoring_setup(num_batch_negs), lhs_prepared, rhs_prepared, lhs_inv, rhs_inv, lhs_neg_inv,
                rhs_neg_inv, disable_lhs, disable_rhs,
            )
            lhs_scores = _side_scores_of(lhs_result, loss)
            rhs_scores = _side_scores_of(rhs_result, loss.new_zeros(()))
        else:
            lhs_pos_vec = _rows(lhs_prepared, lhs_inv)
            rhs_pos_vec = _rows(rhs_prepared, rhs_inv)
            lhs_scores = self._side_scores(
                anchor=rhs_pos_vec, positives=lhs_pos_vec, candidates=lhs_prepared,
                neg_inv=lhs_neg_inv, own=lhs_inv, num_batch_negs=num_batch_negs,
                all_negs=all_negs, disabled=disable_lhs,
            )
            rhs_scores = self._side_scores(
                anchor=lhs_pos_vec, positives=rhs_pos_vec, candidates=rhs_prepared,
                neg_inv=rhs_neg_inv, own=rhs_inv, num_batch_negs=num_batch_negs,
                all_negs=all_negs, disabled=disable_rhs,
            )
        if self.config.regularization_coef > 0:  # only the regulariser needs the raw positive embeddings
            return lhs_scores, rhs_scores, _rows(lhs_base, lhs_inv), _rows(rhs_base, rhs_inv)
        return lhs_scores, rhs_scores, lhs_base, rhs_base

    def _use_fused(self, all_negs: bool) -> bool:
        return self.fused and not all_negs and torch.is_grad_enabled()

    def _scoring_setup(self, num_batch_negs: int) -> ScoringSetup:
        return ScoringSetup(self.config.loss_fn, self.config.margin, num_batch_negs, MASKED_SCORE)

    def _side_scores(
        self,
        anchor: Tensor,
        positives: Optional[Tensor],
        candidates: Tensor,
        neg_inv: Optional[Tensor],
        own: Tensor,
        num_batch_negs: int,
        all_negs: bool,
        disabled: bool,
    ) -> SideScores:
        """Positive scores and negatives for corrupting one side.

        ``anchor`` holds the other side's prepared positive vectors (B x d), ``positives``
        this side's (B x d), ``candidates`` this side's prepared unique rows (U x d).
        """
        comparator = self.comparator
        num_pos = anchor.shape[0]
        if self._use_fused(all_negs) and not disabled and num_pos > 0:
            loss, result = fused_side(self._scoring_setup(num_batch_negs), anchor, candidates, own, neg_inv)
            return _side_scores_of(result, loss)
        if positives is None:  # the fused path gathers its own; only this one needs them as a tensor
            positives = _rows(candidates, own)
        pos = comparator.pos(anchor, positives)
        if disabled or num_pos == 0:
            return SideScores(pos, pos.new_empty((num_pos, 0)))
        if all_negs:
            # every entity of the partition (candidates are the whole table); mask each positive's own column
            scores = comparator.pairwise(anchor, candidates)  # (B, N)
            return SideScores(pos, scores.scatter(1, own.unsqueeze(1), MASKED_SCORE))
        parts: list[Tensor] = []
        chunk = num_batch_negs if num_batch_negs > 0 else (neg_inv.shape[1] if neg_inv is not None else num_pos)
        num_chunks = (num_pos + chunk - 1) // chunk
        padded = num_chunks * chunk
        anchor_chunks = _pad_rows(anchor, padded).view(num_chunks, chunk, -1)
        if num_batch_negs > 0:
            pos_chunks = _pad_rows(positives, padded).view(num_chunks, chunk, -1)
            batch_scores = comparator.pairwise(anchor_chunks, pos_chunks)  # (C, chunk, chunk)
            batch_scores = batch_scores.masked_fill(_batch_mask(num_chunks, chunk, num_pos, anchor.device), MASKED_SCORE)
            parts.append(batch_scores)
        weight_parts: list[Tensor] = []
        if neg_inv is not None and neg_inv.numel():
            num_uniform = neg_inv.shape[1]
            if candidates.shape[0] < num_uniform:
                # Fewer distinct candidates than samples (small vocabularies): score each candidate once and
                # weight it by how often it was drawn for the chunk. Every loss and rank is a sum over the
                # sampled negatives, so this is the same sum without a (chunks x samples) tensor.
                all_scores = comparator.pairwise(anchor_chunks, candidates.unsqueeze(0))  # (C, chunk, U)
                draws = torch.zeros((num_chunks, candidates.shape[0]), dtype=all_scores.dtype, device=all_scores.device)
                draws.scatter_add_(1, neg_inv[:num_chunks], torch.ones_like(neg_inv[:num_chunks], dtype=draws.dtype))
                parts.append(all_scores)
                weight_parts.append(draws.unsqueeze(1).expand(num_chunks, chunk, -1))
            else:
                neg_vecs = _rows(candidates, neg_inv[:num_chunks])  # (C, N, d)
                parts.append(comparator.pairwise(anchor_chunks, neg_vecs))
        if not parts:
            return SideScores(pos, pos.new_empty((num_pos, 0)))
        neg = torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]
        neg = neg.reshape(padded, -1)
        if padded != num_pos:
            neg = neg[:num_pos]
        if not weight_parts:
            return SideScores(pos, neg)
        weights = []
        if num_batch_negs > 0:
            weights.append((~_batch_mask(num_chunks, chunk, num_pos, anchor.device)).to(neg.dtype))
        weights.extend(weight_parts)
        weight = torch.cat(weights, dim=2).reshape(padded, -1)
        if padded != num_pos:
            weight = weight[:num_pos]
        return SideScores(pos, neg, weight, num_neg=(chunk if num_batch_negs > 0 else 0) + neg_inv.shape[1])


def _side_scores_of(result: SideResult, loss: Tensor) -> SideScores:
    # the score blocks' memory now holds their gradients: no negative scores, statistics as ``violators``
    return SideScores(result.pos, result.pos.new_empty((result.pos.shape[0], 0)), None, result.num_neg, loss,
                      result.violators)


def _rows(table: Tensor, index: Tensor) -> Tensor:
    """``table[index]`` through index_select: its backward is an index_add, not the much slower
    accumulating index_put that advanced indexing differentiates to on the CPU."""
    flat = table.index_select(0, index.reshape(-1))
    return flat.view(tuple(index.shape) + tuple(table.shape[1:]))


def _pad_rows(x: Tensor, rows: int) -> Tensor:
    if x.shape[0] == rows:
        return x
    return torch.cat((x, x.new_zeros((rows - x.shape[0],) + tuple(x.shape[1:]))), dim=0)


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
