"""The loss of a side's score matrix held as separate blocks, and its gradient in closed form.

``job.model.fused`` scores a side as a few blocks (the chunk's batch negatives, the uniform negatives)
rather than one concatenated (B x K) matrix, so its losses take the blocks as they are and overwrite each
with its gradient: no concatenation, no autograd replay. They compute the same sums as
``job.model.losses`` (the autograd form) and are registered under the same names, so a loss added there
without its blockwise twin here is caught by tests/test_model_registry.py and falls back to autograd
(``job.model.fused.fused_supported``). Apart from the scorer, which is about chunks and products, so
that each module holds one idea.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from job.model import names
from job.model.registry import Registry

Block = tuple[Tensor, Optional[Tensor]]  # negative scores (R x k) and their weight (broadcastable) or None
# (margin, positive scores, blocks, negatives per positive, rows that count) -> (loss, d pos); blocks become gradients
BlockwiseLoss = Callable[[float, Tensor, list[Block], int, int], tuple[Tensor, Tensor]]

BLOCKWISE_LOSSES: Registry[BlockwiseLoss] = Registry("loss function", names.LOSS_FUNCTIONS)


def blockwise_loss(kind: str, margin: float, pos: Tensor, blocks: list[Block],
                   num_neg: int, num_pos: int) -> tuple[Tensor, Tensor, list[Tensor], Tensor | float]:
    """PBG's loss over [positive | negatives] held as separate blocks, and its gradient.

    ``pos`` (R,): positive scores; ``blocks``: (scores (R x k), weight broadcastable to it or None) for each
    group of negatives, masked entries at a very negative score. Rows past ``num_pos`` (chunk padding) are
    left out of the loss and get zero gradient. The same sums as ``job.model.losses``, without
    concatenating the blocks into one matrix. The blocks are overwritten with their gradients.
    Returns (loss, d pos, d blocks, violators: weighted count of negatives scoring above their positive).
    """
    rows = pos.shape[0]
    column = pos.unsqueeze(1)
    violators: Tensor | float = 0.0  # a tensor: a GPU must not wait for it batch after batch
    for block, weight in blocks:
        above = block[:num_pos].sub(column[:num_pos]).gt_(0)
        violators = violators + (above.mul_(weight[:num_pos]) if weight is not None else above).sum()
    loss, d_pos = BLOCKWISE_LOSSES.get(kind)(margin, pos, blocks, num_neg, num_pos)
    if num_pos < rows:
        d_pos[num_pos:] = 0
        for block, _ in blocks:
            block[num_pos:] = 0
    return loss, d_pos, [block for block, _ in blocks], violators


@BLOCKWISE_LOSSES.register("softmax")
def _softmax_blocks(margin: float, pos: Tensor, blocks: list[Block], num_neg: int,
                    num_pos: int) -> tuple[Tensor, Tensor]:
    top = pos.clone()
    for block, weight in blocks:
        if weight is not None:
            block.add_(weight.log())
        torch.maximum(top, block.amax(1), out=top)
    top_column = top.unsqueeze(1)
    d_pos = torch.exp(pos - top)
    total = d_pos.clone()
    for block, _ in blocks:
        total += block.sub_(top_column).exp_().sum(1)
    loss = (top + total.log() - pos)[:num_pos].sum()
    d_pos.div_(total).sub_(1)
    inverse_total = total.reciprocal_().unsqueeze(1)
    for block, _ in blocks:
        block.mul_(inverse_total)
    return loss, d_pos


@BLOCKWISE_LOSSES.register("ranking")
def _ranking_blocks(margin: float, pos: Tensor, blocks: list[Block], num_neg: int,
                    num_pos: int) -> tuple[Tensor, Tensor]:
    loss = pos.new_zeros(())
    d_pos = torch.zeros_like(pos)
    threshold = (margin - pos).unsqueeze(1)
    for block, weight in blocks:
        violation = block.add_(threshold)
        active = (violation > 0).to(pos.dtype)
        if weight is not None:
            active.mul_(weight)
        loss = loss + (violation.clamp_min_(0) * active)[:num_pos].sum()
        d_pos -= active.sum(1)
        block.copy_(active)
    return loss, d_pos


@BLOCKWISE_LOSSES.register("logistic")
def _logistic_blocks(margin: float, pos: Tensor, blocks: list[Block], num_neg: int,
                     num_pos: int) -> tuple[Tensor, Tensor]:
    loss = F.softplus(-pos)[:num_pos].sum()
    d_pos = torch.sigmoid(-pos).neg_()
    for block, weight in blocks:
        terms = F.softplus(block)
        if weight is not None:
            terms.mul_(weight)
        loss = loss + terms[:num_pos].sum() / num_neg
        block.sigmoid_().div_(num_neg)
        if weight is not None:
            block.mul_(weight)
    return loss, d_pos
