"""The hand-differentiated 1-vs-all softmax (job.model.fused_all) against the autograd path it replaces."""

from __future__ import annotations

import pytest
import torch

from job.config import parse_config
from job.model import fused_all
from job.model.kernel_options import KernelOptions
from job.model.scoring import Model, Table
from job.train.batch.step import BatchContext, run_batch

DIM = 8


def _run(overrides: dict, num_entities: int, num_pos: int, dynamic: bool, options: KernelOptions = KernelOptions()
         ) -> tuple:
    """One trained 1-vs-all float64 batch from a fixed state: (table, Adagrad sums, parameter gradients, stats)."""
    raw = {
        "entities": {"node": {"num_partitions": 1}},
        "relations": [{"name": "r", "lhs": "node", "rhs": "node", "operator": overrides.pop("operator"),
                       "all_negs": True}],
        "dimension": DIM, "entity_path": "x", "edge_paths": ["x"], "checkpoint_path": "x", "batch_size": 60,
        "lr": 0.1, "dynamic_relations": dynamic, "global_emb": False, **overrides,
    }
    config = parse_config(raw)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model = Model(config, 3 if dynamic else 0)
        for param in model.parameters():
            param.data.normal_()
        weight = torch.randn(num_entities, DIM)
        table = Table(weight, torch.zeros(num_entities))
        ctx = BatchContext(config, model, None, {0: table}, {0: table}, 0, 0, options)
        generator = torch.Generator().manual_seed(1)
        lhs = torch.randint(0, num_entities, (num_pos,), generator=generator)
        rhs = torch.randint(0, num_entities, (num_pos,), generator=generator)
        rel = torch.randint(0, 3, (num_pos,), generator=generator) if dynamic else None
        stats = run_batch(ctx, 0, lhs, rhs, rel, generator=generator, train=True)
        grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    finally:
        torch.set_default_dtype(previous)
    return weight, table.optim_sum, grads, stats


def _both(overrides: dict, num_entities: int, num_pos: int, dynamic: bool) -> tuple:
    """(the fused path's result, the autograd path's)."""
    reference = _run(dict(overrides), num_entities, num_pos, dynamic, KernelOptions(fused_all_negs=False))
    return _run(dict(overrides), num_entities, num_pos, dynamic), reference


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("operator", ["complex_diagonal", "linear", "none"])
@pytest.mark.parametrize("disable", [None, "disable_lhs_negs", "disable_rhs_negs"])
@pytest.mark.parametrize("reg", [0.0, 0.05])
def test_one_vs_all_softmax_matches_autograd(dynamic: bool, operator: str, disable: str | None, reg: float) -> None:
    """float64: the same table update, Adagrad sums, relation gradients, loss and regulariser."""
    overrides = {"loss_fn": "softmax", "comparator": "dot", "num_batch_negs": 0, "num_uniform_negs": 0,
                 "operator": operator, "reciprocal_relations": True,
                 "regularization_coef": reg, **({disable: True} if disable else {})}
    (weight, optim_sum, grads, stats), (ref_weight, ref_sum, ref_grads, ref_stats) = _both(
        overrides, num_entities=50, num_pos=37, dynamic=dynamic)
    torch.testing.assert_close(weight, ref_weight, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(optim_sum, ref_sum, rtol=1e-9, atol=1e-9)
    for got, want in zip(grads, ref_grads):
        # a disabled side's operator gets no gradient here, a zero one from autograd: the same (no) step
        if got is None or want is None:
            assert not any(g is not None and bool(g.any()) for g in (got, want))
        else:
            torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-7)
    assert float(stats.loss) == pytest.approx(float(ref_stats.loss), rel=1e-9)
    assert float(stats.reg) == pytest.approx(float(ref_stats.reg), rel=1e-9)
    assert stats.violators_lhs == ref_stats.violators_lhs
    assert stats.violators_rhs == ref_stats.violators_rhs


def test_query_rows_in_blocks_sum_as_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """The score matrix formed a few queries at a time gives the same loss and gradients."""
    torch.manual_seed(0)
    queries, table = torch.randn(23, 6, dtype=torch.float64), torch.randn(40, 6, dtype=torch.float64)
    targets = torch.randint(0, 40, (23,))
    whole = fused_all.all_negs_softmax(queries, table, targets, None, (10, 13))
    monkeypatch.setattr(fused_all, "MAX_QUERY_ROWS", 4)
    blocks = fused_all.all_negs_softmax(queries, table, targets, None, (10, 13))
    for got, want in zip(blocks, whole):
        torch.testing.assert_close(got, want)
    q, t = queries.clone().requires_grad_(True), table.clone().requires_grad_(True)
    loss = (torch.logsumexp(q @ t.T, 1) - (q * t[targets]).sum(1)).sum()
    loss.backward()
    torch.testing.assert_close(whole[0], loss.detach())
    torch.testing.assert_close(whole[2], q.grad)
    torch.testing.assert_close(whole[3], t.grad)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available() or not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                    reason="needs native bfloat16 products")
def test_bfloat16_products_stay_near_float32() -> None:
    """bfloat16 inputs to the products, float32 softmax and gradients: within bfloat16's rounding."""
    torch.manual_seed(0)
    queries, table = torch.randn(64, 32) * 0.5, torch.randn(300, 32) * 0.5
    targets = torch.randint(0, 300, (64,))
    loss, _, d_q, d_t = fused_all.all_negs_softmax(queries, table, targets, torch.bfloat16)
    ref_loss, _, ref_q, ref_t = fused_all.all_negs_softmax(queries.double(), table.double(), targets, None)
    assert d_q.dtype == d_t.dtype == torch.float32
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-2)
    torch.testing.assert_close(d_q.double(), ref_q, rtol=0.05, atol=0.02)
    torch.testing.assert_close(d_t.double(), ref_t, rtol=0.05, atol=0.02)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available() or not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                    reason="needs native bfloat16 products")
def test_a_well_fit_target_keeps_its_gradient_in_bfloat16() -> None:
    """p_target near 1: p - 1 is below bfloat16's spacing there; the target's gradient must not round to 0."""
    table = torch.zeros(14, 4)
    table[0, 0] = 1.0
    queries = torch.tensor([[9.0, 0.0, 0.0, 0.0]])  # p_target = e^9 / (e^9 + 13) ~ 0.9984
    _, _, d_q, d_t = fused_all.all_negs_softmax(queries, table, torch.tensor([0]), torch.bfloat16)
    _, _, ref_q, ref_t = fused_all.all_negs_softmax(queries.double(), table.double(), torch.tensor([0]), None)
    assert float(d_t[0, 0]) < 0
    torch.testing.assert_close(d_t.double(), ref_t, rtol=0.02, atol=1e-4)
    torch.testing.assert_close(d_q.double(), ref_q, rtol=0.02, atol=1e-4)
