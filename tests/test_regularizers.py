"""The regularisers (``regularization_coef`` > 0): N3's and DURA's values and gradients in closed form, float64,
which factors they take, and the config's refusals."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from job.config import parse_config
from job.config.base import ConfigKeyError
from job.model.kernel_options import KernelOptions
from job.model.operators import Operator
from job.model.regularizers import cubed_magnitudes, dura_penalty, n3_penalty
from job.model.scoring import Model, Table
from job.train.batch.step import BatchContext, run_batch


def test_complex_modulus_cubed_and_its_gradient() -> None:
    """|z|^3 per complex coordinate; d/d(re) = 3 |z| re, d/d(im) = 3 |z| im (finite at z = 0)."""
    torch.manual_seed(0)
    x = torch.randn(7, 10, dtype=torch.float64)
    x[0, 0] = x[0, 5] = 0.0  # a zero coordinate: the modulus has no gradient there, its cube has 0
    x.requires_grad_(True)
    value = cubed_magnitudes(x, True)
    real, imag = x.detach()[:, :5], x.detach()[:, 5:]
    modulus = (real.square() + imag.square()).sqrt()
    assert float(value) == pytest.approx(float(modulus.pow(3).sum()), rel=1e-12)
    value.backward()
    assert x.grad is not None
    torch.testing.assert_close(x.grad, torch.cat((3 * modulus * real, 3 * modulus * imag), 1), rtol=1e-12, atol=0)
    assert torch.autograd.gradcheck(lambda t: cubed_magnitudes(t, True), (torch.randn(3, 4, dtype=torch.float64,
                                                                                        requires_grad=True),))


def test_real_coordinates_abs_cubed_and_its_gradient() -> None:
    x = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    value = cubed_magnitudes(x, False)
    value.backward()
    assert x.grad is not None
    torch.testing.assert_close(x.grad, 3 * x.detach().abs() * x.detach(), rtol=1e-12, atol=0)


def test_dynamic_relations_are_counted_once_per_edge_static_ones_times_the_batch() -> None:
    torch.manual_seed(0)
    lhs, rhs = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)
    entities = cubed_magnitudes(lhs, True) + cubed_magnitudes(rhs, True)
    dynamic = Operator("complex_diagonal", 6, 3).double()
    with torch.no_grad():
        dynamic.real.normal_()
        dynamic.imag.normal_()
    rel = torch.tensor([0, 2, 2, 1])
    per_edge = sum(float(((dynamic.real[r] ** 2 + dynamic.imag[r] ** 2) ** 1.5).sum()) for r in rel.tolist())
    assert float(n3_penalty([dynamic], rel, lhs, rhs, 4)) == pytest.approx(float(entities) + per_edge, rel=1e-12)
    static = Operator("diagonal", 6).double()
    with torch.no_grad():
        static.diagonal.normal_()
    real_entities = cubed_magnitudes(lhs, False) + cubed_magnitudes(rhs, False)
    expected = float(real_entities) + 4 * float(static.diagonal.abs().pow(3).sum())
    assert float(n3_penalty([static, Operator("none", 6)], None, lhs, rhs, 4)) == pytest.approx(expected, rel=1e-12)


def test_shared_relations_form_counts_operator_parameters_once_per_batch() -> None:
    """biggraph's earlier form (preset: quality): coordinates' |x|^3 per edge, every operator parameter once."""
    torch.manual_seed(0)
    lhs, rhs = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)
    dynamic = Operator("complex_diagonal", 6, 3).double()
    with torch.no_grad():
        dynamic.real.normal_()
    expected = (lhs.abs().pow(3).sum() + rhs.abs().pow(3).sum() + dynamic.real.abs().pow(3).sum()
                + dynamic.imag.abs().pow(3).sum())
    got = n3_penalty([dynamic], torch.tensor([0, 2, 2, 1]), lhs, rhs, 4, "N3_shared_relations")
    assert float(got) == pytest.approx(float(expected), rel=1e-12)


def test_pbg_defaults_leave_the_regulariser_off() -> None:
    """A PBG config (no regularization_coef) trains without any penalty: PBG's results are unchanged."""
    from job.config import parse_config

    config = parse_config({"entities": {"e": {"num_partitions": 1}},
                           "relations": [{"name": "r", "lhs": "e", "rhs": "e", "operator": "complex_diagonal"}],
                           "dimension": 4, "entity_path": "x", "edge_paths": ["x"], "checkpoint_path": "x"})
    assert config.regularization_coef == 0.0 and config.regularizer == "N3"
    assert config.compute_dtype is None and config.eval_fraction == 0.05


# DURA -----------------------------------------------------------------------------------------------------------


def _complex(x: torch.Tensor) -> torch.Tensor:
    """[real | imag] rows as complex numbers."""
    half = x.shape[-1] // 2
    return torch.complex(x[..., :half], x[..., half:])


def _random_operator(kind: str, dim: int, num_rels: int = 0, seed: int = 0) -> Operator:
    """An operator with normal parameters (not the identity it starts at: every term must matter)."""
    torch.manual_seed(seed)
    operator = Operator(kind, dim, num_rels).double()
    with torch.no_grad():
        for name in operator.param_names:
            getattr(operator, name).normal_()
    return operator


def test_dura_on_complex_coordinates_is_the_papers_sum_of_moduli() -> None:
    """ComplEx, dynamic, reciprocal: per edge and direction 0.5 (|q|^2 + |t|^2) + 1.5 (|q|^2 |r|^2 + |t|^2 |r|^2)
    with complex moduli, each direction through its own operator and each edge's relation (the paper's DURA_W)."""
    torch.manual_seed(1)
    lhs, rhs = torch.randn(5, 8, dtype=torch.float64), torch.randn(5, 8, dtype=torch.float64)
    rel = torch.tensor([0, 2, 2, 1, 0])
    h_r, g_r = _random_operator("complex_diagonal", 8, 3, seed=2), _random_operator("complex_diagonal", 8, 3, seed=3)

    def direction(operator: Operator, query: torch.Tensor, target: torch.Tensor) -> float:
        r = torch.complex(operator.real.detach()[rel], operator.imag.detach()[rel])
        q, t = _complex(query).abs().square(), _complex(target).abs().square()
        return float((0.5 * (q + t) + 1.5 * (q * r.abs().square() + t * r.abs().square())).sum())

    expected = direction(h_r, rhs, lhs) + direction(g_r, lhs, rhs)
    assert float(dura_penalty(h_r, g_r, rel, lhs, rhs)) == pytest.approx(expected, rel=1e-12)
    # the relation enters only through its moduli: a phase rotation of r changes nothing
    with torch.no_grad():
        real, imag = h_r.real.clone(), h_r.imag.clone()
        h_r.real.copy_(real * 0.6 - imag * 0.8)
        h_r.imag.copy_(real * 0.8 + imag * 0.6)
    assert float(dura_penalty(h_r, g_r, rel, lhs, rhs)) == pytest.approx(expected, rel=1e-12)


def test_dura_gradients_in_closed_form() -> None:
    """d/dq = (1 + 3 |r|^2) q per direction a row takes part in; d/d re(r) = 3 (|q|^2 + |t|^2) re(r) summed over
    the edges of r; and gradcheck over every input."""
    torch.manual_seed(4)
    lhs = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    rhs = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    operator = _random_operator("complex_diagonal", 6, seed=5)  # static: one r for the whole batch
    dura_penalty(operator, None, None, lhs, rhs).backward()  # one direction: (v, h_r) ranking u
    modulus = operator.real.detach().square() + operator.imag.detach().square()  # |r|^2, (3,)
    factor = torch.cat((1 + 3 * modulus, 1 + 3 * modulus))
    assert lhs.grad is not None and rhs.grad is not None and operator.real.grad is not None
    torch.testing.assert_close(lhs.grad, factor * lhs.detach(), rtol=1e-12, atol=0)
    torch.testing.assert_close(rhs.grad, factor * rhs.detach(), rtol=1e-12, atol=0)
    norms = _complex(lhs.detach()).abs().square().sum(0) + _complex(rhs.detach()).abs().square().sum(0)
    torch.testing.assert_close(operator.real.grad, 3 * norms * operator.real.detach(), rtol=1e-12, atol=0)
    dynamic = _random_operator("complex_diagonal", 6, 3, seed=6)
    rel = torch.tensor([2, 0, 2, 1])
    inputs = (lhs.detach().clone().requires_grad_(True), rhs.detach().clone().requires_grad_(True))
    assert torch.autograd.gradcheck(lambda q, t: dura_penalty(dynamic, dynamic, rel, q, t), inputs)

    def through_params(real: torch.Tensor, imag: torch.Tensor) -> torch.Tensor:
        """The same penalty as a function of the operator's parameters (the tensors gradcheck perturbs)."""
        op = Operator("complex_diagonal", 6, 3).double()
        op._parameters["real"], op._parameters["imag"] = real, imag
        return dura_penalty(op, op, rel, lhs.detach(), rhs.detach())

    params = (dynamic.real.detach().clone().requires_grad_(True), dynamic.imag.detach().clone().requires_grad_(True))
    assert torch.autograd.gradcheck(through_params, params)


def test_dura_with_real_operators() -> None:
    """diagonal (DistMult/CP): (q d)^2 and (t d)^2; linear (RESCAL): |M q|^2 and |M^T t|^2; none: r = 1."""
    torch.manual_seed(7)
    lhs, rhs = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    own = 0.5 * float(lhs.square().sum() + rhs.square().sum())
    diagonal = _random_operator("diagonal", 4, seed=8)
    d = diagonal.diagonal.detach()
    expected = own + 1.5 * float((rhs * d).square().sum() + (lhs * d).square().sum())
    assert float(dura_penalty(diagonal, None, None, lhs, rhs)) == pytest.approx(expected, rel=1e-12)
    linear = _random_operator("linear", 4, seed=9)
    m = linear.linear_transformation.detach()
    # the reverse query h_r(v) = M v ranks u by <u, M v> = <M^T u, v>
    expected = own + 1.5 * float((rhs @ m.T).square().sum() + (lhs @ m).square().sum())
    assert float(dura_penalty(linear, None, None, lhs, rhs)) == pytest.approx(expected, rel=1e-12)
    assert float(dura_penalty(Operator("none", 4).double(), None, None, lhs, rhs)) == pytest.approx(4 * own, rel=1e-12)


def test_dura_counts_one_direction_without_reciprocal_scoring() -> None:
    """PBG's static scoring c(u, f_r(v)) is one query per edge: half of what the same operator twice gives when the
    two sides are swapped copies."""
    torch.manual_seed(10)
    rows = torch.randn(6, 4, dtype=torch.float64)
    operator = _random_operator("complex_diagonal", 4, seed=11)
    once = float(dura_penalty(operator, None, None, rows, rows))
    assert float(dura_penalty(operator, operator, None, rows, rows)) == pytest.approx(2 * once, rel=1e-12)


def _config(operator: str = "complex_diagonal", **extra: Any) -> Any:
    raw = {"entities": {"e": {"num_partitions": 1}},
           "relations": [{"name": "r", "lhs": "e", "rhs": "e", "operator": operator}],
           "dimension": 4, "entity_path": "x", "edge_paths": ["x"], "checkpoint_path": "x",
           "comparator": "dot", "regularizer": "DURA", "regularization_coef": 0.1, **extra}
    return parse_config(raw)


@pytest.mark.parametrize("operator", ["translation", "affine"])
def test_dura_refuses_operators_with_an_additive_term(operator: str) -> None:
    with pytest.raises(ConfigKeyError, match=r"'relations\[0\]\.operator'.*DURA.*" + operator):
        _config(operator)
    assert _config(operator, regularization_coef=0.0).regularizer == "DURA"  # off: nothing to refuse


@pytest.mark.parametrize("comparator", ["cos", "l2", "squared_l2"])
def test_dura_refuses_comparators_other_than_dot(comparator: str) -> None:
    with pytest.raises(ConfigKeyError, match=f"'comparator'.*DURA.*'{comparator}'"):
        _config(comparator=comparator)


@pytest.mark.parametrize("operator", ["complex_diagonal", "diagonal", "linear", "none"])
def test_dura_accepts_bilinear_operators(operator: str) -> None:
    assert _config(operator, comparator="dot").regularizer == "DURA"


def _one_vs_all_batch(options: KernelOptions, reg: float) -> tuple[Any, torch.Tensor, list[torch.Tensor], Any]:
    """One reciprocal 1-vs-all float64 batch with DURA from a fixed state: (stats, table after, relation grads,
    the expected penalty computed on the state before)."""
    config = parse_config({
        "entities": {"node": {"num_partitions": 1}},
        "relations": [{"name": "r", "lhs": "node", "rhs": "node", "operator": "complex_diagonal", "all_negs": True}],
        "dimension": 6, "entity_path": "x", "edge_paths": ["x"], "checkpoint_path": "x", "batch_size": 40,
        "dynamic_relations": True, "global_emb": False, "loss_fn": "softmax", "comparator": "dot",
        "num_batch_negs": 0, "num_uniform_negs": 0, "regularizer": "DURA", "regularization_coef": reg})
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model = Model(config, 3)
        for param in model.parameters():
            param.data.normal_()
        weight = torch.randn(30, 6)
        table = Table(weight, torch.zeros(30))
        ctx = BatchContext(config, model, None, {0: table}, {0: table}, 0, 0, options)
        generator = torch.Generator().manual_seed(1)
        lhs, rhs = torch.randint(0, 30, (17,), generator=generator), torch.randint(0, 30, (17,), generator=generator)
        rel = torch.randint(0, 3, (17,), generator=generator)
        rhs_op, lhs_op = model.rhs_operators[0], model.lhs_operators[0]
        assert isinstance(rhs_op, Operator) and isinstance(lhs_op, Operator)
        with torch.no_grad():
            expected = dura_penalty(rhs_op, lhs_op, rel, weight[lhs].clone(), weight[rhs].clone())
        stats = run_batch(ctx, 0, lhs, rhs, rel, generator=generator, train=True)
        grads = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
    finally:
        torch.set_default_dtype(previous)
    return stats, weight, grads, expected


def test_dura_in_a_training_batch() -> None:
    """The trainer adds coef x DURA of the batch's positives (``stats.reg``), the hand-differentiated 1-vs-all path
    and autograd's agree on it and on its gradients, and it moves the relations' gradients."""
    stats, weight, grads, expected = _one_vs_all_batch(KernelOptions(), 0.1)
    assert float(stats.reg) == pytest.approx(0.1 * float(expected), rel=1e-12)
    ref_stats, ref_weight, ref_grads, _ = _one_vs_all_batch(KernelOptions(fused_all_negs=False), 0.1)
    assert float(ref_stats.reg) == pytest.approx(float(stats.reg), rel=1e-12)
    torch.testing.assert_close(weight, ref_weight, rtol=1e-9, atol=1e-9)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-7)
    _, _, plain_grads, _ = _one_vs_all_batch(KernelOptions(), 0.0)
    assert all(not torch.allclose(got, plain) for got, plain in zip(grads, plain_grads))
