"""1-vs-all softmax (``all_negs`` with the ``softmax`` loss and a dot comparator), differentiated by hand.

Each query (the other side's positive through its operator) is scored against every row of the table and
the loss is the cross-entropy of its own row among them, ``logsumexp(q . E^T) - q . e_target`` (what the
autograd path computes as ``logsumexp([pos, masked negatives]) - pos``). Left to autograd that is two
(B x N) products forward, four backward and a dozen passes over (B x N) score matrices per batch (a
masked copy, a concatenation, logsumexp's exp and its backward's exp, sub and mul): on WN18RR's 40,943
rows at d=256 about half of a batch's time went to those passes (bench/RESULTS.md, issue #33).

Here the queries of both sides of a reciprocal batch are stacked when they rank the same table, so the
batch is three products of (2B x N x d): the scores, the queries' gradient ``G E`` and the table's
``G^T Q``, with ``G = softmax(scores) - onehot(target)`` (torch's fused softmax: one pass over the scores).
With a reduced ``compute_dtype`` (bfloat16) the scores and ``G`` are held in it for the products (oneDNN's
products accumulate in float32 and round their result), but the softmax is written in float32 and the one-hot
subtracted there: a well-fit target's ``p - 1`` is below bfloat16's spacing near 1 (2^-8) and would round to 0,
while its negatives' gradients would not (on Nations, 14 entities, that cost 0.05 MRR). The gradients handed
back are float32.

``label_smoothing`` (eps) makes the target distribution ``(1 - eps) onehot(target) + eps / N`` over the N rows, as
torch's ``cross_entropy(label_smoothing=eps)`` does: the loss becomes ``-log p_target + eps (s_target - mean_j s_j)``
(the cross-entropy with the smoothed target, rewritten with ``logsumexp = s_target - log p_target``) and ``G = softmax
- (1 - eps) onehot - eps / N``. The two scores the loss needs are recomputed in float32 from the queries (one
product with the table's mean row), whatever ``compute_dtype``; with eps = 0 nothing of this runs.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

# Rows of the score matrix formed at a time: bounds the (rows x N) float32 scratch; on WN18RR's 40,943 rows
# 2,048 queries take 335 MB (both sides of a batch of 1,000 at once).
MAX_QUERY_ROWS = 2048

# Violators (rows above the target, a training statistic) are counted exactly up to this many scores a
# block, then on every k-th query (scaled up): an exact count cost more than the softmax on WN18RR.
VIOLATOR_ENTRIES = 1 << 22


class _AllNegsSoftmax(torch.autograd.Function):
    """loss = sum_i logsumexp(Q_i . E^T) - Q_i . E_{t_i}; the gradients are computed in forward."""

    @staticmethod
    def forward(ctx: Any, queries: Tensor, table: Tensor, targets: Tensor, compute_dtype: Optional[torch.dtype],
                splits: tuple[int, ...], label_smoothing: float) -> tuple[Tensor, Tensor]:
        loss, violators, d_queries, d_table = all_negs_softmax(queries.detach(), table.detach(), targets,
                                                               compute_dtype, splits, label_smoothing)
        ctx.grads = (d_queries, d_table)
        ctx.mark_non_differentiable(violators)
        return loss, violators

    @staticmethod
    def backward(ctx: Any, grad: Tensor, _violators: Tensor) -> tuple[Optional[Tensor], ...]:
        grads, ctx.grads = ctx.grads, None
        if grads is None:
            raise RuntimeError("1-vs-all scoring: its gradients were handed over by an earlier backward "
                               "(retain_graph is not supported on the fused path)")
        d_queries, d_table = grads
        if not (grad.device.type == "cpu" and bool(grad == 1)):  # the relation's weight, nearly always 1
            d_queries, d_table = d_queries.mul_(grad), d_table.mul_(grad)
        return d_queries, d_table, None, None, None, None


@torch.no_grad()
def all_negs_softmax(queries: Tensor, table: Tensor, targets: Tensor, compute_dtype: Optional[torch.dtype] = None,
                     splits: tuple[int, ...] = (), label_smoothing: float = 0.0
                     ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(loss, violators per split, d_queries, d_table) of 1-vs-all softmax, without autograd.

    ``queries`` (Q x d), ``table`` (N x d), ``targets`` (Q,) the row each query should rank first. The loss
    is summed over the queries; ``violators`` counts, for each consecutive group of queries of the sizes
    ``splits`` (one group when empty), the rows scoring above the target (estimated from every k-th query
    of a group beyond ``VIOLATOR_ENTRIES`` scores).

    With a reduced ``compute_dtype`` the score matrix is held in it; torch's softmax reads it and writes
    float32, the one-hot is subtracted in float32 and the result cast down once for the two gradient
    products. The loss is read off the softmax at the target, ``-log p_target`` (recomputed in float32 from
    the scores where ``p_target`` is too small for that). ``label_smoothing``: see the module's docstring.
    """
    acc = table.dtype
    low = compute_dtype if compute_dtype is not None and compute_dtype != acc else None
    table_low = table.to(low) if low is not None else table
    num_queries = queries.shape[0]
    d_queries = torch.empty_like(queries, dtype=acc)
    d_table: Optional[Tensor] = None
    loss = torch.zeros((), dtype=acc, device=table.device)
    bounds = [0]
    for size in splits or (num_queries,):
        bounds.append(bounds[-1] + size)
    violators = torch.zeros(len(bounds) - 1, dtype=torch.int64, device=table.device)
    tiny = torch.finfo(acc).tiny * 1e8  # below it ``-log p`` has lost digits (subnormals): take logsumexp
    # label smoothing's share of each query's loss is eps (s_target - mean_j s_j): s . mean row, in float32
    mean_row = table.mean(0, dtype=acc) if label_smoothing > 0 else None
    for begin in range(0, num_queries, MAX_QUERY_ROWS):
        end = min(begin + MAX_QUERY_ROWS, num_queries)
        q_low = queries[begin:end].to(low if low is not None else acc)
        scores = torch.mm(q_low, table_low.t())
        rows = torch.arange(end - begin, device=table.device)
        target = targets[begin:end]
        # the softmax in float32 whatever the scores' dtype: near 1, bfloat16 cannot hold 1 - p (its spacing
        # there is 2^-8), so a well-fit target's gradient would round to 0 while its negatives' did not
        grad = torch.softmax(scores, 1, dtype=acc)
        p_target = grad[rows, target]
        # counting is slower than the softmax itself on a large table (a bool reduction): every
        # ``stride``-th query is counted for its group and stands for the ``stride`` around it
        stride = max(1, (end - begin) * grad.shape[1] // VIOLATOR_ENTRIES)
        for group, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
            lo, hi = max(lo, begin) - begin, min(hi, end) - begin
            if lo < hi:
                counted = rows[lo:hi:stride]
                above = torch.count_nonzero(grad.index_select(0, counted) > p_target[counted].unsqueeze(1))
                violators[group] += above * (hi - lo) // counted.numel() if stride > 1 else above
        p_acc = p_target.to(acc)
        small = torch.nonzero(p_acc < tiny).flatten()
        loss += -p_acc.clamp_min(tiny).log().sum()
        if small.numel():
            picked = scores.index_select(0, small).to(acc)
            exact = torch.logsumexp(picked, 1) - picked[torch.arange(small.numel()), target[small]]
            loss += (exact + p_acc[small].clamp_min(tiny).log()).sum()
        del scores
        if mean_row is not None:
            q_acc = queries[begin:end].to(acc)
            s_target = (q_acc * table.index_select(0, target).to(acc)).sum(1)
            loss += label_smoothing * (s_target - q_acc @ mean_row).sum()
            grad[rows, target] -= 1.0 - label_smoothing
            grad.sub_(label_smoothing / grad.shape[1])
        else:
            grad[rows, target] -= 1.0
        if low is not None:
            grad = grad.to(low)
        d_queries[begin:end] = torch.mm(grad, table_low)
        d_part = torch.mm(grad.t(), q_low)
        if d_table is None:
            d_table = d_part.to(acc) if low is not None else d_part
        else:
            d_table += d_part
    if d_table is None:
        d_table = torch.zeros_like(table)
    return loss, violators, d_queries, d_table


def applies(comparator_kind: str, bias: bool, loss_fn: str) -> bool:
    """Whether 1-vs-all training with these settings can take this path (training only: see ``softmax_all``; the
    caller also asks ``KernelOptions.fused_all_negs``: off, the autograd path, which tests hold this one to)."""
    return comparator_kind == "dot" and not bias and loss_fn == "softmax"


def softmax_all(queries: Tensor, table: Tensor, targets: Tensor, compute_dtype: Optional[torch.dtype],
                splits: tuple[int, ...] = (), label_smoothing: float = 0.0) -> tuple[Tensor, Tensor]:
    """The summed 1-vs-all softmax loss (differentiable in ``queries`` and ``table``) and the violators per split;
    ``label_smoothing``: the target's smoothing (``label_smoothing`` of the config, 0 off)."""
    loss, violators = _AllNegsSoftmax.apply(queries, table, targets, compute_dtype, tuple(splits),
                                            float(label_smoothing))
    return loss, violators
