"""``label_smoothing`` of the 1-vs-all softmax (issue #33): both paths against torch's cross_entropy.

The fused path (job.model.fused_all, gradients written out) and the autograd path (job.model.losses'
``smoothed_softmax_loss`` on the masked score matrix) are each held to ``F.cross_entropy(label_smoothing=)``, value
and gradients, in float64; a trained batch is the same on both; with label_smoothing 0 the fused batch is bit for
bit the computation it was before the option existed, and the autograd path never calls the smoothed loss.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from job.config import parse_config
from job.model import fused_all, losses
from job.model.kernel_options import KernelOptions
from job.model.scoring import MASKED_SCORE, Model, Table
from job.train.batch import step
from job.train.batch.step import BatchContext, run_batch

EPS = (0.0, 0.1, 0.3)


def _case(queries: int = 9, rows: int = 13, dim: int = 6, dtype: torch.dtype = torch.float64):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(queries, dim, generator=g, dtype=dtype)
    table = torch.randn(rows, dim, generator=g, dtype=dtype)
    targets = torch.randint(0, rows, (queries,), generator=g)
    return q, table, targets


def _torch_reference(q: torch.Tensor, table: torch.Tensor, targets: torch.Tensor, eps: float):
    q, table = q.clone().requires_grad_(True), table.clone().requires_grad_(True)
    loss = F.cross_entropy(q @ table.t(), targets, label_smoothing=eps, reduction="sum")
    loss.backward()
    return loss.detach(), q.grad, table.grad


@pytest.mark.parametrize("eps", EPS)
@pytest.mark.parametrize("blocks", [False, True])
def test_fused_matches_torch_cross_entropy(eps: float, blocks: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if blocks:  # queries in blocks of 4 (the last one short), summed as one
        monkeypatch.setattr(fused_all, "MAX_QUERY_ROWS", 4)
    q, table, targets = _case()
    want_loss, want_dq, want_dt = _torch_reference(q, table, targets, eps)
    q_leaf, table_leaf = q.clone().requires_grad_(True), table.clone().requires_grad_(True)
    loss, _ = fused_all.softmax_all(q_leaf, table_leaf, targets, None, (4, 5), eps)
    loss.backward()
    torch.testing.assert_close(loss.detach(), want_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(q_leaf.grad, want_dq, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(table_leaf.grad, want_dt, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("eps", EPS)
def test_autograd_path_matches_torch_cross_entropy(eps: float) -> None:
    """The autograd path's form: the positive apart, its own column of the (B x N) negatives masked."""
    q, table, targets = _case()
    want_loss, want_dq, want_dt = _torch_reference(q, table, targets, eps)
    q_leaf, table_leaf = q.clone().requires_grad_(True), table.clone().requires_grad_(True)
    scores = q_leaf @ table_leaf.t()
    pos = scores.gather(1, targets.unsqueeze(1)).squeeze(1)
    neg = scores.scatter(1, targets.unsqueeze(1), MASKED_SCORE)
    loss = losses.smoothed_softmax_loss(pos, neg, eps)
    loss.backward()
    torch.testing.assert_close(loss.detach(), want_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(q_leaf.grad, want_dq, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(table_leaf.grad, want_dt, rtol=1e-10, atol=1e-12)


def test_bfloat16_products_stay_close() -> None:
    """With bfloat16 products (compute_dtype) the smoothed gradient keeps float32's up to bfloat16's rounding."""
    q, table, targets = _case(dtype=torch.float32)
    _, want_dq, want_dt = _torch_reference(q, table, targets, 0.2)
    _, _, d_queries, d_table = fused_all.all_negs_softmax(q, table, targets, torch.bfloat16, (), 0.2)
    torch.testing.assert_close(d_queries, want_dq, rtol=0.05, atol=0.05)
    torch.testing.assert_close(d_table, want_dt, rtol=0.05, atol=0.05)


def _batch(eps: float, options: KernelOptions, monkeypatch: pytest.MonkeyPatch | None = None) -> tuple:
    """One trained float64 1-vs-all batch (reciprocal ComplEx) from a fixed state: (table, sums, grads, loss)."""
    raw = {
        "entities": {"node": {"num_partitions": 1}},
        "relations": [{"name": "r", "lhs": "node", "rhs": "node", "operator": "complex_diagonal", "all_negs": True}],
        "dimension": 8, "entity_path": "x", "edge_paths": ["x"], "checkpoint_path": "x", "batch_size": 40,
        "lr": 0.1, "global_emb": False, "loss_fn": "softmax", "comparator": "dot", "num_batch_negs": 0,
        "num_uniform_negs": 0, "reciprocal_relations": True, "label_smoothing": eps,
    }
    config = parse_config(raw)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model = Model(config)
        for param in model.parameters():
            param.data.normal_()
        weight = torch.randn(30, 8)
        table = Table(weight, torch.zeros(30))
        ctx = BatchContext(config, model, None, {0: table}, {0: table}, 0, 0, options)
        generator = torch.Generator().manual_seed(1)
        lhs = torch.randint(0, 30, (23,), generator=generator)
        rhs = torch.randint(0, 30, (23,), generator=generator)
        stats = run_batch(ctx, 0, lhs, rhs, None, generator=generator, train=True)
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    finally:
        torch.set_default_dtype(previous)
    return weight, table.optim_sum, grads, float(stats.loss)


@pytest.mark.parametrize("eps", [0.1, 0.25])
def test_a_trained_batch_is_the_same_on_both_paths(eps: float) -> None:
    fused = _batch(eps, KernelOptions())
    reference = _batch(eps, KernelOptions(fused_all_negs=False))
    for got, want in zip(fused[:2], reference[:2]):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    assert len(fused[2]) == len(reference[2]) > 0
    for got, want in zip(fused[2], reference[2]):
        torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-7)
    assert fused[3] == pytest.approx(reference[3], rel=1e-9)
    # and smoothing changed the batch
    plain = _batch(0.0, KernelOptions())
    assert not torch.allclose(fused[0], plain[0])


def _before(queries: torch.Tensor, table: torch.Tensor, targets: torch.Tensor):
    """The fused 1-vs-all softmax as it was before label_smoothing (one block, float32), op for op."""
    scores = torch.mm(queries, table.t())
    rows = torch.arange(queries.shape[0])
    grad = torch.softmax(scores, 1, dtype=torch.float32)
    p_target = grad[rows, targets]
    loss = -p_target.clamp_min(torch.finfo(torch.float32).tiny * 1e8).log().sum()
    grad[rows, targets] -= 1.0
    return loss, torch.mm(grad, table), torch.mm(grad.t(), queries)


def test_off_is_bit_identical_to_before(monkeypatch: pytest.MonkeyPatch) -> None:
    q, table, targets = _case(queries=50, rows=200, dim=16, dtype=torch.float32)
    loss, _, d_queries, d_table = fused_all.all_negs_softmax(q, table, targets, None, (), 0.0)
    want = _before(q, table, targets)
    for got, expected in zip((loss, d_queries, d_table), want):
        assert torch.equal(got, expected)

    # the autograd path with label_smoothing 0 never takes the smoothed loss
    def refuse(*args: object) -> None:
        raise AssertionError("smoothed_softmax_loss called with label_smoothing 0")

    monkeypatch.setattr(step, "smoothed_softmax_loss", refuse)
    _batch(0.0, KernelOptions(fused_all_negs=False))
