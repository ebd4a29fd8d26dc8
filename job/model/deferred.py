"""Positive rows gathered off the autograd graph, their gradient added to the table rows' after backward.

A batch gathers its rows from a table once (a leaf, ~21,000 x d on a large table: every occurrence of
its positives and negatives). Reciprocal scoring then gathers the 1,000 positives again from that leaf
to put them through the relation operator. Left to autograd, the backward of that second gather is a
zero-filled gradient of the whole leaf with the positives' rows added in, and the engine then sums it
with the gradient the fused scorer hands the leaf: two extra passes over ~17 MB per side, ~25% of a
WordNet batch (bench/RESULTS.md). Gathering the positives as their own leaf and adding their gradient
into the rows' (``index_add_`` of 1,000 rows) after backward is the same sum without those passes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class DeferredRows:
    """``rows[inv]`` as the leaf ``positives``; ``merge`` adds its gradient to ``rows.grad``."""

    rows: Tensor  # the leaf of gathered table rows
    inv: Tensor  # (B,) positions of the positives in ``rows``
    positives: Tensor  # (B x d) leaf, a copy of ``rows[inv]``

    def merge(self) -> None:
        """After ``backward``: the positives' gradient into the rows' (what autograd would have summed)."""
        grad = self.positives.grad
        if grad is None:
            return
        if self.rows.grad is None:
            self.rows.grad = torch.zeros_like(self.rows)
        self.rows.grad.index_add_(0, self.inv, grad)
        self.positives.grad = None


def gather_positives(rows: Tensor, inv: Tensor, defer: bool) -> tuple[Tensor, DeferredRows | None]:
    """``rows[inv]``, as its own leaf with a ``DeferredRows`` when ``defer`` (``KernelOptions.deferred_positives``)
    and ``rows`` is a leaf being trained.

    Anything else (evaluation, rows computed from a leaf: global embeddings, feature bags) is gathered
    through autograd as usual and needs no merge; so is everything with ``defer`` off (the reference
    tests/test_fused.py compares against).
    """
    if not (defer and torch.is_grad_enabled() and rows.is_leaf and rows.requires_grad):
        return rows.index_select(0, inv), None
    positives = rows.detach().index_select(0, inv).requires_grad_(True)
    return positives, DeferredRows(rows, inv, positives)
