"""PBG's losses in torch, one registered class per name of ``job.model.names.LOSS_FUNCTIONS``.

``compute_loss`` is the autograd form used by evaluation and by the comparators the fused path
does not handle; ``job.model.fused_losses`` has the same sums with their gradients written out
(``BLOCKWISE_LOSSES``, registered under the same names).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from job.model import names
from job.model.registry import Registry


class LossKind:
    """One of PBG's losses, summed over the batch. ``pos``: (B,), ``neg``: (B, K); ``weight`` counts each column."""

    @staticmethod
    def loss(margin: float, pos: Tensor, neg: Tensor, weight: Optional[Tensor], num_neg: int) -> Tensor:
        raise NotImplementedError

    @staticmethod
    def without_negatives(pos: Tensor) -> Tensor:
        """The loss of positives with no negatives to compare them with (B > 0, K == 0)."""
        return pos.sum() * 0.0


LOSSES: Registry[type[LossKind]] = Registry("loss function", names.LOSS_FUNCTIONS)


@LOSSES.register("ranking")
class RankingLoss(LossKind):
    """sum(max(0, margin - pos + neg))."""

    @staticmethod
    def loss(margin: float, pos: Tensor, neg: Tensor, weight: Optional[Tensor], num_neg: int) -> Tensor:
        violation = (margin - pos.unsqueeze(1) + neg).clamp_min(0)
        return (violation * weight).sum() if weight is not None else violation.sum()


@LOSSES.register("logistic")
class LogisticLoss(LossKind):
    """BCE(pos, 1) plus the mean over negatives of BCE(neg, 0)."""

    @staticmethod
    def loss(margin: float, pos: Tensor, neg: Tensor, weight: Optional[Tensor], num_neg: int) -> Tensor:
        pos_loss = F.binary_cross_entropy_with_logits(pos, torch.ones_like(pos), reduction="sum")
        neg_terms = F.softplus(neg)  # = BCE with logits against 0
        neg_loss = (neg_terms * weight).sum() if weight is not None else neg_terms.sum()
        return pos_loss + neg_loss / num_neg

    @staticmethod
    def without_negatives(pos: Tensor) -> Tensor:
        return F.binary_cross_entropy_with_logits(pos, torch.ones_like(pos), reduction="sum")


@LOSSES.register("softmax")
class SoftmaxLoss(LossKind):
    """logsumexp([pos, negatives]) - pos; a weight w adds log w to its column's logit."""

    @staticmethod
    def loss(margin: float, pos: Tensor, neg: Tensor, weight: Optional[Tensor], num_neg: int) -> Tensor:
        logits = neg if weight is None else neg + weight.log()
        return (torch.logsumexp(torch.cat((pos.unsqueeze(1), logits), dim=1), dim=1) - pos).sum()


# scores at or below this are masked out (``job.model.scoring.MASKED_SCORE`` is -1e9): not candidates
MASKED_BELOW = -1e8


def smoothed_softmax_loss(pos: Tensor, neg: Tensor, label_smoothing: float) -> Tensor:
    """The softmax loss with a smoothed target, summed over the batch (the autograd form of ``label_smoothing``;
    ``job.model.fused_all`` has it written out for the 1-vs-all batch).

    The candidates are the positive and the unmasked negatives (1-vs-all: every entity, the positive's own column
    of ``neg`` masked); the target puts ``1 - eps`` on the positive and ``eps`` spread evenly over all candidates,
    as torch's ``cross_entropy(label_smoothing=eps)``: ``logsumexp - (1 - eps) pos - eps mean(candidates)``. No
    column weights: sampled negatives (drawn with repeats) are refused by the config."""
    logits = torch.cat((pos.unsqueeze(1), neg), dim=1)
    valid = neg > MASKED_BELOW
    mean = (pos + torch.where(valid, neg, torch.zeros_like(neg)).sum(1)) / (1 + valid.sum(1)).to(pos.dtype)
    return (torch.logsumexp(logits, dim=1) - (1.0 - label_smoothing) * pos - label_smoothing * mean).sum()


def compute_loss(kind: str, margin: float, pos: Tensor, neg: Tensor, weight: Optional[Tensor] = None,
                 num_neg: Optional[int] = None) -> Tensor:
    """PBG's losses, summed over the batch. ``pos``: (B,), ``neg``: (B, K); ``weight`` counts each column."""
    loss = LOSSES.get(kind)
    num_pos, width = neg.shape
    if num_pos == 0:
        return pos.sum() * 0.0
    if width == 0:
        return loss.without_negatives(pos)
    return loss.loss(margin, pos, neg, weight, width if num_neg is None else num_neg)
