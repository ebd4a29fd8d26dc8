"""Both sides of a static relation scored together, by hand; under ``dot``, the operator on the anchors.

A static relation scores (u, r, v) as ``c(u, f_r(v))``, the operator on the rhs only. Each side's
positives are the other side's anchors, and the two sides' batch products are each other's
transpose, so ``pair_scores`` computes that product once (``job.model.fused.score_side`` does the rest).

With the ``dot`` comparator and an operator ``f(x) = L x + t`` (every PBG operator: ``t`` is zero but
for translation and affine), the rhs side's uniform negatives v' score

    <u, L v' + t> = <L^T u, v'> + <u, t>

so ``fused_pair_adjoint`` applies ``L^T`` (``Operator.adjoint``: the transpose, the conjugate for
complex_diagonal) to the B anchors u and adds ``<u, t>`` to their rows of scores, instead of applying
``f`` to every unique rhs row and differentiating it: on a mid-size graph those are the ~20k distinct
uniform draws of a batch against ~1000 anchors, and the operator's forward and backward over them
was a third of the batch. The rhs positives (batch negatives and positive scores) are still scored
after ``f``; only B rows of them. The rows' gradients are taken through ``L`` by hand (``L`` for the
anchors, ``L^T`` for the positives), and the operator's parameters get theirs from autograd, from the
transformed positives, the anchors' adjoint and the shift: the same sums as before, grouped otherwise.
The ``cos`` comparator normalises ``f(v')`` and the distance comparators are not inner products: they
keep ``fused_pair`` (``cos``) or the autograd path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from job.model.fused import (
    ScoringSetup,
    SideResult,
    attach_gradients,
    chunk_rows,
    flowed,
    negatives_in_place,
    score_side,
)
from job.model.operators import Operator
from job.model.side import Side


def adjoint_applies(comparator: str, operator: Operator) -> bool:
    """Whether ``fused_pair_adjoint`` serves this comparator and (static) operator (the caller also asks
    ``KernelOptions.operator_adjoint``: off, ``fused_pair`` runs instead, for the benchmark and tests)."""
    return comparator == "dot" and not operator.dynamic and "linear" in vars(operator.spec)


def fused_pair(setup: ScoringSetup, *, lhs: Side, rhs: Side) -> tuple[Tensor, SideResult, SideResult]:
    """Both sides of a static relation: each side's positives are the other's anchors.

    ``lhs.rows`` / ``rhs.rows``: the prepared unique rows of each side (rhs after the operator). Each row's
    gradient from every role it plays (positive, anchor, negative) is summed before autograd sees it.
    """
    with torch.no_grad():
        d_left, d_right = torch.zeros_like(lhs.rows), torch.zeros_like(rhs.rows)
        left, right = setup.low(lhs.rows.detach()), setup.low(rhs.rows.detach())
        pair = pair_scores(
            setup, lhs=ScoredSide(left, left.index_select(0, lhs.inv), lhs.neg_inv, lhs.negs_disabled, d_left),
            rhs=ScoredSide(right, right.index_select(0, rhs.inv), rhs.neg_inv, rhs.negs_disabled, d_right))
        d_left.index_add_(0, lhs.inv, pair.d_left_pos)
        d_right.index_add_(0, rhs.inv, pair.d_right_pos)
    loss = attach_gradients(pair.loss, (lhs.rows, rhs.rows), (d_left, d_right))
    return loss, pair.lhs_side, pair.rhs_side


def fused_pair_adjoint(setup: ScoringSetup, operator: Operator, *, lhs: Side,
                       rhs: Side) -> tuple[Tensor, SideResult, SideResult]:
    """``fused_pair`` for ``dot`` with ``lhs.rows`` / ``rhs.rows`` the unique rows *before* the rhs ``operator``.

    ``lhs.rows is rhs.rows`` (one gather for both sides) shares one gradient buffer.
    """
    lhs_rows, rhs_rows, lhs_inv, rhs_inv = lhs.rows, rhs.rows, lhs.inv, rhs.inv
    num_pos = lhs_inv.shape[0]
    same = lhs_rows is rhs_rows
    # every occurrence gathered (job.train.batch.rowops.select_rows): [positives | negatives] in order, each row's
    # gradient written where it lies; otherwise summed into zeroed buffers
    left_layout = None if same else in_order(lhs_rows.shape[0], lhs_inv, None if lhs.negs_disabled else lhs.neg_inv)
    right_layout = None if same else in_order(rhs_rows.shape[0], rhs_inv, None if rhs.negs_disabled else rhs.neg_inv)
    with torch.no_grad():
        left_raw = lhs_rows.detach()[:num_pos] if left_layout is not None else lhs_rows.detach().index_select(0, lhs_inv)
        right_raw = (rhs_rows.detach()[:num_pos] if right_layout is not None
                     else rhs_rows.detach().index_select(0, rhs_inv))
    # autograd reaches the operator's parameters from here, not the rows (detached: theirs are taken by hand)
    right_pos = operator(right_raw)
    uniform = not rhs.negs_disabled and rhs.neg_inv is not None and rhs.neg_inv.numel() > 0
    anchor = operator.adjoint(left_raw) if uniform else None
    anchor = None if anchor is left_raw else anchor  # the identity: score the uniform draws against u itself
    translation = operator.additive() if uniform else None
    shift = None if translation is None else (left_raw * translation).sum(1)
    with torch.no_grad():
        d_left = torch.zeros_like(lhs_rows) if left_layout is None else torch.empty_like(lhs_rows)
        d_right = d_left if same else torch.zeros_like(rhs_rows) if right_layout is None else torch.empty_like(rhs_rows)
        left = setup.low(lhs_rows.detach())
        right = left if same else setup.low(rhs_rows.detach())
        if setup.compute_dtype is None:
            left_pos = left_raw  # ``left`` is ``lhs_rows`` itself
        else:
            left_pos = left[:num_pos] if left_layout is not None else left.index_select(0, lhs_inv)
        pair = pair_scores(
            setup, lhs=ScoredSide(left, left_pos, lhs.neg_inv, lhs.negs_disabled, d_left, left_layout),
            rhs=ScoredSide(right, setup.low(right_pos.detach()), rhs.neg_inv, rhs.negs_disabled, d_right, right_layout),
            uniform_anchor=None if anchor is None else setup.low(anchor.detach()),
            shift=None if shift is None else shift.detach())
        d_left_pos = pair.d_left_pos
        d_anchor = d_shift = None
        if anchor is not None:
            d_anchor = flowed(pair.rhs_side.d_uniform_anchor, "uniform anchors")[:num_pos]
            d_left_pos = d_left_pos.add_(operator.linear(d_anchor))  # d u = L d(L^T u)
        if shift is not None and translation is not None:
            d_shift = flowed(pair.rhs_side.d_shift, "shift")[:num_pos]
            d_left_pos = d_left_pos.addr_(d_shift, translation)  # d u = t d<u, t>
        _add_positives(d_left, lhs_inv, d_left_pos, left_layout)
        _add_positives(d_right, rhs_inv, operator.adjoint(pair.d_right_pos), right_layout)  # d v = L^T d(L v + t)
    inputs, grads = [lhs_rows], [d_left]
    if not same:
        inputs.append(rhs_rows)
        grads.append(d_right)
    for value, grad in ((right_pos, pair.d_right_pos), (anchor, d_anchor), (shift, d_shift)):
        if value is not None and grad is not None and value.requires_grad:
            inputs.append(value)
            grads.append(grad)
    return attach_gradients(pair.loss, inputs, grads), pair.lhs_side, pair.rhs_side


def in_order(num_rows: int, inv: Tensor, neg_inv: Optional[Tensor]) -> Optional[int]:
    """Where the negatives start when a side's rows are its positives in order, then its uniform negatives one
    row per draw (``job.train.batch.rowops.every_occurrence``, the CPU's layout for large tables); None otherwise.

    Then the positives are the first rows themselves (no gather) and every row's gradient is written where it
    lies (no zeroed buffer, no scatter-add): ``score_side`` writes the negatives', ``_add_positives`` the
    positives'. Read from the indices (``negatives_in_place``), so no caller has to vouch for the layout.
    """
    num_pos = inv.shape[0]
    if negatives_in_place(inv, num_rows) != 0:
        return None
    if neg_inv is None:
        return num_pos if num_rows == num_pos else None
    start = negatives_in_place(neg_inv, num_rows)
    return start if start == num_pos and num_rows == num_pos + neg_inv.numel() else None


def _add_positives(d_rows: Tensor, inv: Tensor, d_pos: Tensor, layout: Optional[int]) -> None:
    """The positives' gradients into their rows: written (``in_order`` layout) or summed."""
    if layout is None:
        d_rows.index_add_(0, inv, d_pos)
    else:
        d_rows[: inv.shape[0]].copy_(d_pos)


@dataclass
class PairResult:
    loss: Tensor  # both sides' (no gradient attached)
    lhs_side: SideResult
    rhs_side: SideResult
    d_left_pos: Tensor  # (B, d): the gradient with respect to the lhs positives, every role summed
    d_right_pos: Tensor  # (B, d): the same for the rhs positives (as scored: after the operator)


@dataclass(frozen=True)
class ScoredSide:
    """One side as ``pair_scores`` scores it: its rows and positives in the products' dtype, its negatives, and
    the buffer its rows' gradients go to."""

    rows: Tensor  # (U x d): the side's unique rows (or every occurrence), in ``setup.compute_dtype``
    positives: Tensor  # (B x d): its positives as scored (the rhs ones after the operator)
    neg_inv: Optional[Tensor]  # (chunks x N): its uniform negatives' rows in ``rows``, or None
    negs_disabled: bool  # never corrupted: no batch or uniform negatives, no loss of its own
    d_rows: Tensor  # (U x d): its negatives' gradients are added here (written, with ``negatives_at``)
    # the negatives lie in ``rows`` from here on in draw order (``in_order``): their gradients are written in place
    negatives_at: Optional[int] = None


def pair_scores(setup: ScoringSetup, *, lhs: ScoredSide, rhs: ScoredSide, uniform_anchor: Optional[Tensor] = None,
                shift: Optional[Tensor] = None) -> PairResult:
    """Both sides' losses and row gradients, without autograd; the negatives' gradients go to each side's
    ``d_rows``. All rows are in ``setup.compute_dtype`` (see ``score_side``). The lhs side's batch product (rhs
    positives x lhs positives) is the transpose of the rhs side's, so it is computed, and differentiated, once.
    ``uniform_anchor`` / ``shift``: the rhs side's uniform negatives scored against them instead of the lhs
    positives (``score_side``).
    """
    left_pos, right_pos = lhs.positives, rhs.positives
    disable_lhs, disable_rhs = lhs.negs_disabled, rhs.negs_disabled
    num_pos = left_pos.shape[0]
    acc = lhs.d_rows.dtype
    off = ScoringSetup(setup.loss_fn, setup.margin, 0, setup.masked_score, setup.native_loss, setup.compute_dtype)
    share = setup.num_batch_negs > 0 and not disable_lhs and not disable_rhs
    product = transposed = None
    if share:
        chunk = setup.num_batch_negs
        product = torch.bmm(chunk_rows(right_pos, chunk), chunk_rows(left_pos, chunk).transpose(1, 2)).to(acc)
        transposed = product.transpose(1, 2).contiguous()  # each side overwrites its own
    lhs_side = score_side(off if disable_lhs else setup, right_pos, left_pos, lhs.rows,
                          neg_inv=None if disable_lhs else lhs.neg_inv, d_cand=lhs.d_rows, batch_product=product,
                              defer_batch=share,
                          negatives_at=lhs.negatives_at)
    rhs_side = score_side(off if disable_rhs else setup, left_pos, right_pos, rhs.rows,
                          neg_inv=None if disable_rhs else rhs.neg_inv, d_cand=rhs.d_rows, batch_product=transposed,
                              defer_batch=share,
                          uniform_anchor=uniform_anchor, shift=shift, negatives_at=rhs.negatives_at)
    d_left_pos = _sum_grads(lhs_side.d_positives, rhs_side.d_anchor)
    d_right_pos = _sum_grads(rhs_side.d_positives, lhs_side.d_anchor)
    if share:
        chunk = setup.num_batch_negs
        joint = flowed(lhs_side.d_batch, "lhs batch product").add_(
            flowed(rhs_side.d_batch, "rhs batch product").transpose(1, 2)).to(lhs.rows.dtype)  # rows: rhs positives
        dim = lhs.rows.shape[1]
        from_batch_right = torch.bmm(joint, chunk_rows(left_pos, chunk)).view(-1, dim).to(acc)
        from_batch_left = torch.bmm(joint.transpose(1, 2), chunk_rows(right_pos, chunk)).view(-1, dim).to(acc)
        d_left_pos = _sum_grads(d_left_pos, from_batch_left)
        d_right_pos = _sum_grads(d_right_pos, from_batch_right)
    d_left_pos, d_right_pos = flowed(d_left_pos, "lhs positives"), flowed(d_right_pos, "rhs positives")
    return PairResult(lhs_side.loss + rhs_side.loss, lhs_side, rhs_side, d_left_pos[:num_pos], d_right_pos[:num_pos])


def _sum_grads(first: Optional[Tensor], second: Optional[Tensor]) -> Optional[Tensor]:
    if first is None:
        return second
    if second is None:
        return first
    rows = min(first.shape[0], second.shape[0])  # a side without negatives is not padded
    return first[:rows].add_(second[:rows]) if rows == first.shape[0] else second[:rows].add_(first[:rows])
