"""Negative scoring and its loss, differentiated by hand.

Scoring a side of a batch is a handful of chunked matrix products (positives against the
chunk's other positives and against the sampled negatives), a concatenation, a mask and a
loss over the (B x K) score matrix. Autograd records every one of those steps and replays
them backwards with an allocation and a pass over memory per step; on graphs where each
batch touches thousands of distinct rows that bookkeeping was half of the batch time
(bench/RESULTS.md). Here the forward pass runs without autograd, the gradient of the loss
with respect to the scores has a closed form for each of PBG's losses, and the gradients
with respect to the rows are the transposed matrix products. They are handed back to
autograd through one node, so the operators, comparator preparation and global embeddings
around it stay differentiated as before.

Two shortcuts keep the passes over memory down: a positive's score is the diagonal of its
chunk's batch-negative product (which the mask discards anyway), so its gradient rides in
the same backward product; and the statistics (violators) are counted on the score matrix
while it is still in cache.

Used when training with the ``dot`` or ``cos`` comparator (both score prepared vectors by a
dot product) and no bias; anything else takes the autograd path in ``model.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor


class _AttachGradients(torch.autograd.Function):
    """A precomputed loss whose gradients with respect to two inputs are already known."""

    @staticmethod
    def forward(ctx: Any, first: Tensor, second: Tensor, loss: Tensor, d_first: Tensor, d_second: Tensor) -> Tensor:
        ctx.save_for_backward(d_first, d_second)
        return loss.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], ...]:
        d_first, d_second = ctx.saved_tensors
        return d_first.mul_(grad), d_second.mul_(grad), None, None, None


def fused_supported(comparator: str, bias: bool, loss_fn: str) -> bool:
    return comparator in ("dot", "cos") and not bias and loss_fn in ("ranking", "logistic", "softmax")


@dataclass
class ScoringSetup:
    """What every side of a batch shares."""

    loss_fn: str
    margin: float
    num_batch_negs: int
    masked_score: float


@dataclass
class SideResult:
    loss: Tensor  # 0-dim, no gradient attached yet
    pos: Tensor  # (B,)
    neg: Tensor  # (B, K); for the softmax loss only its shape is kept (its memory holds the gradient)
    weight: Optional[Tensor]  # (B, K) draw counts, or None
    num_neg: int
    violators: float
    # gradients with respect to the (padded) anchor and positive rows; None where nothing flowed
    d_anchor: Optional[Tensor]  # (padded, d)
    d_positives: Optional[Tensor]  # (padded, d)
    # with ``defer_batch``: the gradient of the (chunks x chunk x chunk) batch product, positives on its diagonal
    d_batch: Optional[Tensor] = None


def loss_and_score_grad(kind: str, margin: float, scores: Tensor, weight: Optional[Tensor], num_neg: int,
                        num_pos: int) -> tuple[Tensor, Tensor]:
    """Loss over the first ``num_pos`` rows of ``scores`` (column 0 the positive, then the negatives) and
    its gradient with respect to ``scores`` (same shape; rows past ``num_pos``, chunk padding, get zero).

    The same sums as ``model.compute_loss``; ``weight`` (without the positive's column) counts each negative.
    ``scores`` is overwritten where the gradient can reuse its memory.
    """
    rows = scores[:num_pos]
    pos = rows[:, 0].clone()
    padded = scores.shape[0] != num_pos
    if kind == "softmax":
        if weight is not None:
            rows[:, 1:] += weight.log()
        top = rows.amax(1, keepdim=True)
        probs = rows.sub_(top).exp_()  # in place: the scores are not needed any more
        total = probs.sum(1)
        loss = (top.squeeze(1) + total.log() - pos).sum()
        probs.div_(total.unsqueeze(1))
        probs[:, 0] -= 1
        if padded:
            scores[num_pos:] = 0
        return loss, scores
    grad = scores.new_zeros(scores.shape)
    neg = rows[:, 1:]
    if kind == "ranking":
        violation = neg + (margin - pos).unsqueeze(1)
        active = (violation > 0).to(scores.dtype)
        if weight is not None:
            active.mul_(weight)
        loss = (violation.clamp_min_(0) * active).sum() if weight is not None else violation.clamp_min_(0).sum()
        grad[:num_pos, 1:] = active
        grad[:num_pos, 0] = -active.sum(1)
    elif kind == "logistic":
        loss = F.softplus(-pos).sum()
        grad[:num_pos, 0] = -torch.sigmoid(-pos)
        if neg.shape[1]:
            terms = F.softplus(neg)
            neg_sum = (terms * weight).sum() if weight is not None else terms.sum()
            loss = loss + neg_sum / num_neg
            neg_grad = torch.sigmoid(neg).div_(num_neg)
            grad[:num_pos, 1:] = neg_grad * weight if weight is not None else neg_grad
    else:
        raise ValueError(f"unknown loss {kind}")
    return loss, grad


def score_side(setup: ScoringSetup, a: Tensor, positives: Tensor, cand: Tensor, neg_inv: Optional[Tensor],
               batch_mask: Optional[Tensor], d_cand: Tensor, batch_product: Optional[Tensor] = None,
               defer_batch: bool = False) -> SideResult:
    """One side's loss and gradients, all without autograd.

    ``a`` (B x d): the other side's prepared positives (the anchor); ``positives`` (B x d): this side's;
    ``cand`` (U x d): this side's prepared unique rows, ``neg_inv`` (chunks x N) the uniform negatives'
    rows in it. The negatives' gradient is added to ``d_cand``; the anchor's and positives' are returned.
    ``batch_product`` (chunks x chunk x chunk) is the anchors-by-positives product when the caller has it;
    ``defer_batch`` returns its gradient instead of multiplying it out (the caller shares the product).
    """
    num_pos, dim = a.shape
    num_batch_negs = setup.num_batch_negs
    num_uniform = neg_inv.shape[1] if neg_inv is not None and neg_inv.numel() else 0
    if num_batch_negs == 0 and num_uniform == 0:
        pos = (a * positives).sum(1)
        loss, grad = loss_and_score_grad(setup.loss_fn, setup.margin, pos.unsqueeze(1).clone(), None, 1, num_pos)
        d_pos = grad[:, :1]
        return SideResult(loss, pos, pos.new_empty((num_pos, 0)), None, 0, 0.0, positives * d_pos, a * d_pos)
    chunk = num_batch_negs if num_batch_negs > 0 else num_uniform
    a_chunks, p_chunks, padded = chunk_rows(a, chunk), chunk_rows(positives, chunk), chunk_rows.padded(num_pos, chunk)
    num_chunks = padded // chunk
    weighted = 0 < cand.shape[0] < num_uniform  # fewer distinct rows than draws: score each row once, weighted
    uniform_width = cand.shape[0] if weighted else num_uniform
    batch_width = chunk if num_batch_negs > 0 else 0
    width = 1 + batch_width + uniform_width
    # one (padded x width) matrix: [positive | batch negatives | uniform negatives], filled in place
    scores = a.new_empty((num_chunks, chunk, width))
    batch_view = scores[:, :, 1 : 1 + batch_width]
    uniform_view = scores[:, :, 1 + batch_width :]
    if num_batch_negs > 0:
        batch_view.copy_(batch_product if batch_product is not None else torch.bmm(a_chunks, p_chunks.transpose(1, 2)))
        # a positive's score is its own entry of the batch product: the diagonal the mask hides
        scores[:, :, 0] = batch_view.diagonal(dim1=1, dim2=2)
        batch_view.masked_fill_(batch_mask, setup.masked_score)
    else:
        scores[:, :, 0] = (a_chunks * p_chunks).sum(2)
    neg_vecs = None
    draws = None
    if weighted:
        uniform_view.copy_(torch.matmul(a_chunks, cand.t()))
        draws = torch.zeros((num_chunks, cand.shape[0]), dtype=a.dtype, device=a.device)
        draws.scatter_add_(1, neg_inv[:num_chunks], torch.ones_like(neg_inv[:num_chunks], dtype=a.dtype))
    elif num_uniform:
        neg_vecs = cand.index_select(0, neg_inv[:num_chunks].reshape(-1)).view(num_chunks, num_uniform, dim)
        uniform_view.copy_(torch.bmm(a_chunks, neg_vecs.transpose(1, 2)))
    flat = scores.view(padded, width)
    pos = flat[:num_pos, 0].clone()
    weight = None
    if weighted:
        weight_full = a.new_empty((num_chunks, chunk, width - 1))
        if batch_width:
            weight_full[:, :, :batch_width] = (~batch_mask).to(a.dtype)
        weight_full[:, :, batch_width:] = draws.unsqueeze(1)
        weight = weight_full.view(padded, width - 1)[:num_pos]
        violators = float(flat[:num_pos, 1:].sub(pos.unsqueeze(1)).gt_(0).mul_(weight).sum())
    else:
        # the positive's own column compares equal, so counting over the whole row counts the negatives
        violators = float(flat[:num_pos].sub(pos.unsqueeze(1)).gt_(0).sum())
    num_neg = batch_width + num_uniform if weighted else width - 1
    neg = flat[:num_pos, 1:]
    loss, d_flat = loss_and_score_grad(setup.loss_fn, setup.margin, flat, weight, num_neg, num_pos)
    d_chunks = d_flat.view(num_chunks, chunk, width)
    d_a: Optional[Tensor] = None
    d_p: Optional[Tensor] = None
    d_batch: Optional[Tensor] = None
    if num_batch_negs > 0:
        d_batch = d_chunks[:, :, 1 : 1 + batch_width]
        # masked entries have zero gradient; the positives' gradient goes on the diagonal
        d_batch.diagonal(dim1=1, dim2=2).copy_(d_chunks[:, :, 0])
        d_batch = d_batch.contiguous()
        if not defer_batch:
            d_a = torch.bmm(d_batch, p_chunks)
            d_p = torch.bmm(d_batch.transpose(1, 2), a_chunks)
            d_batch = None
    else:
        d_pos = d_chunks[:, :, 0:1]
        d_a = p_chunks * d_pos
        d_p = a_chunks * d_pos
    if weighted:
        d_uniform = d_chunks[:, :, 1 + batch_width :]
        uniform_part = torch.matmul(d_uniform, cand)
        d_a = uniform_part if d_a is None else d_a.add_(uniform_part)
        d_cand.addmm_(d_uniform.reshape(padded, -1).t(), a_chunks.view(padded, dim))
    elif num_uniform:
        d_uniform = d_chunks[:, :, 1 + batch_width :]
        d_a = torch.bmm(d_uniform, neg_vecs) if d_a is None else d_a.baddbmm_(d_uniform, neg_vecs)
        d_neg = torch.bmm(d_uniform.transpose(1, 2), a_chunks)
        d_cand.index_add_(0, neg_inv[:num_chunks].reshape(-1), d_neg.view(-1, dim))
    return SideResult(loss, pos, neg, weight, num_neg, violators,
                      None if d_a is None else d_a.view(padded, dim), None if d_p is None else d_p.view(padded, dim),
                      d_batch)


class _ChunkRows:
    """Rows (B x d) as (chunks x chunk x d), zero-padded to whole chunks."""

    @staticmethod
    def padded(num_rows: int, chunk: int) -> int:
        return (num_rows + chunk - 1) // chunk * chunk

    def __call__(self, rows: Tensor, chunk: int) -> Tensor:
        padded = self.padded(rows.shape[0], chunk)
        if padded != rows.shape[0]:
            rows = torch.cat((rows, rows.new_zeros((padded - rows.shape[0], rows.shape[1]))))
        return rows.view(padded // chunk, chunk, rows.shape[1])


chunk_rows = _ChunkRows()


def fused_side(setup: ScoringSetup, anchor: Tensor, candidates: Tensor, own: Tensor, neg_inv: Optional[Tensor],
               batch_mask: Optional[Tensor]) -> tuple[Tensor, SideResult]:
    """One side whose anchor is its own tensor (dynamic relations transform each positive separately)."""
    num_pos = anchor.shape[0]
    with torch.no_grad():
        cand = candidates.detach()
        d_cand = torch.zeros_like(cand)
        result = score_side(setup, anchor.detach(), cand.index_select(0, own), cand, neg_inv, batch_mask, d_cand)
        d_cand.index_add_(0, own, result.d_positives[:num_pos])
        d_anchor = result.d_anchor[:num_pos].contiguous()
    loss = _AttachGradients.apply(anchor, candidates, result.loss, d_anchor, d_cand)
    return loss, result


def fused_pair(setup: ScoringSetup, lhs: Tensor, rhs: Tensor, lhs_inv: Tensor, rhs_inv: Tensor,
               lhs_neg_inv: Optional[Tensor], rhs_neg_inv: Optional[Tensor], batch_mask: Optional[Tensor],
               disable_lhs: bool, disable_rhs: bool) -> tuple[Tensor, SideResult, SideResult]:
    """Both sides of a static relation: each side's positives are the other's anchors.

    ``lhs`` / ``rhs``: the prepared unique rows of each side (rhs after the operator). The lhs side's
    batch product (rhs positives x lhs positives) is the transpose of the rhs side's, so it is computed,
    and differentiated, once. Each row's gradient from every role it plays (positive, anchor, negative)
    is summed before autograd sees it.
    """
    num_pos = lhs_inv.shape[0]
    with torch.no_grad():
        left, right = lhs.detach(), rhs.detach()
        left_pos, right_pos = left.index_select(0, lhs_inv), right.index_select(0, rhs_inv)
        d_left, d_right = torch.zeros_like(left), torch.zeros_like(right)
        off = ScoringSetup(setup.loss_fn, setup.margin, 0, setup.masked_score)
        share = setup.num_batch_negs > 0 and not disable_lhs and not disable_rhs
        product = None
        if share:
            chunk = setup.num_batch_negs
            product = torch.bmm(chunk_rows(right_pos, chunk), chunk_rows(left_pos, chunk).transpose(1, 2))
        lhs_side = score_side(off if disable_lhs else setup, right_pos, left_pos, left,
                              None if disable_lhs else lhs_neg_inv, batch_mask, d_left, product, share)
        rhs_side = score_side(off if disable_rhs else setup, left_pos, right_pos, right,
                              None if disable_rhs else rhs_neg_inv, batch_mask, d_right,
                              None if product is None else product.transpose(1, 2), share)
        d_left_pos = _sum_grads(lhs_side.d_positives, rhs_side.d_anchor)
        d_right_pos = _sum_grads(rhs_side.d_positives, lhs_side.d_anchor)
        if share:
            chunk = setup.num_batch_negs
            joint = lhs_side.d_batch.add_(rhs_side.d_batch.transpose(1, 2))  # rows: rhs positives
            from_batch_right = torch.bmm(joint, chunk_rows(left_pos, chunk)).view(-1, left.shape[1])
            from_batch_left = torch.bmm(joint.transpose(1, 2), chunk_rows(right_pos, chunk)).view(-1, left.shape[1])
            d_left_pos = _sum_grads(d_left_pos, from_batch_left)
            d_right_pos = _sum_grads(d_right_pos, from_batch_right)
        assert d_left_pos is not None and d_right_pos is not None
        d_left.index_add_(0, lhs_inv, d_left_pos[:num_pos])
        d_right.index_add_(0, rhs_inv, d_right_pos[:num_pos])
        total = lhs_side.loss + rhs_side.loss
    loss = _AttachGradients.apply(lhs, rhs, total, d_left, d_right)
    return loss, lhs_side, rhs_side


def _sum_grads(first: Optional[Tensor], second: Optional[Tensor]) -> Optional[Tensor]:
    if first is None:
        return second
    if second is None:
        return first
    rows = min(first.shape[0], second.shape[0])  # a side without negatives is not padded
    return first[:rows].add_(second[:rows]) if rows == first.shape[0] else second[:rows].add_(first[:rows])
