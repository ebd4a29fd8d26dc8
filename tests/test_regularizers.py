"""N3 (``regularization_coef`` > 0): its value and gradient in closed form, float64, and which factors it takes."""

from __future__ import annotations

import pytest
import torch

from job.model.operators import Operator
from job.model.regularizers import cubed_magnitudes, n3_penalty


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
