"""The operator, comparator and loss names: declared once, implemented by torch and numpy alike, offered by the config.

``job.model.names`` declares them (torch-free); ``job.model`` registers the torch implementations and
``job.archive.scoring`` the numpy serving twin against those declarations. A name the config offers
without an implementation, or an implementation the archive lacks, fails here rather than in a
user's job (or in a served model).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from job import config as config_module
from job.archive.scoring import NUMPY_COMPARATORS, NUMPY_OPERATORS, NumpyComparator, apply_operator
from job.model import names
from job.model.comparators import COMPARATORS, Comparator
from job.model.fused_losses import BLOCKWISE_LOSSES
from job.model.losses import LOSSES, compute_loss
from job.model.operators import OPERATORS, Operator
from job.model.registry import Registry, UnknownNameError

REPO = Path(__file__).resolve().parent.parent


def test_every_declared_name_has_a_torch_and_a_numpy_implementation() -> None:
    assert OPERATORS.names() == NUMPY_OPERATORS.names() == names.OPERATORS
    assert COMPARATORS.names() == NUMPY_COMPARATORS.names() == names.COMPARATORS
    assert LOSSES.names() == BLOCKWISE_LOSSES.names() == names.LOSS_FUNCTIONS
    for registry in (OPERATORS, NUMPY_OPERATORS, COMPARATORS, NUMPY_COMPARATORS, LOSSES, BLOCKWISE_LOSSES):
        assert registry.missing() == (), registry


def test_config_choices_are_the_registries_names() -> None:
    assert set(config_module.OPERATORS) == set(OPERATORS.names())
    assert set(config_module.COMPARATORS) == set(COMPARATORS.names())
    assert set(config_module.LOSS_FUNCTIONS) == set(LOSSES.names())
    for name in config_module.OPERATORS:
        assert OPERATORS.get(name) is not None and NUMPY_OPERATORS.get(name) is not None
    for name in config_module.COMPARATORS:
        assert COMPARATORS.get(name) is not None and NUMPY_COMPARATORS.get(name) is not None
    for name in config_module.LOSS_FUNCTIONS:
        assert LOSSES.get(name) is not None


def test_unknown_names_list_the_choices() -> None:
    with pytest.raises(UnknownNameError, match=r"unknown operator 'rotate' \(expected one of none, .*, complex_diagonal\)"):
        Operator("rotate", 4)
    with pytest.raises(ValueError, match=r"unknown comparator 'manhattan' \(expected one of dot, cos, l2, squared_l2\)"):
        Comparator("manhattan", False)
    with pytest.raises(ValueError, match=r"unknown comparator 'manhattan'"):
        NumpyComparator("manhattan", False)
    with pytest.raises(ValueError, match=r"unknown loss function 'hinge' \(expected one of ranking, logistic, softmax\)"):
        compute_loss("hinge", 0.1, torch.zeros(2), torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"unknown operator 'rotate'"):
        apply_operator("rotate", {}, np.zeros((1, 4), np.float32))


def test_every_operator_has_its_own_adjoint() -> None:
    """``biggraph grow`` places a new row through its relation's operator's adjoint (or inverse, for the
    distance comparators): an operator registered without one would fail only when a model using it grows."""
    for name in names.OPERATORS:
        assert "adjoint" in vars(OPERATORS.get(name)), name
        for num in (0, 2):
            op = Operator(name, 4, num)
            rel = torch.tensor([0, 1, 1]) if num else None
            for inverse in (False, True):
                assert op.adjoint(torch.ones(3, 4), rel, inverse=inverse).shape == (3, 4), (name, num, inverse)


def test_distance_comparators_say_so() -> None:
    """The flag ``biggraph grow`` reads to choose an operator's inverse over its adjoint."""
    distance = {name for name in names.COMPARATORS if not COMPARATORS.get(name).dot_product}
    assert distance == {"l2", "squared_l2"}


def test_registry_refuses_undeclared_and_duplicate_names() -> None:
    registry: Registry[int] = Registry("widget", declared=("a", "b"))
    registry.register("a")(1)
    assert registry.names() == ("a",) and registry.missing() == ("b",) and "a" in registry and len(registry) == 1
    with pytest.raises(ValueError, match="widget 'c' is not declared"):
        registry.register("c")(3)
    with pytest.raises(ValueError, match="registered twice"):
        registry.register("a")(2)
    assert registry.get("a") == 1
    free: Registry[str] = Registry("thing")
    free.register("z")("last")
    free.register("y")("first")
    assert free.names() == ("z", "y") and list(free) == ["z", "y"]


@pytest.mark.parametrize("kind", names.OPERATORS)
@pytest.mark.parametrize("dynamic", [False, True])
def test_numpy_operators_match_torch(kind: str, dynamic: bool) -> None:
    torch.manual_seed(0)
    operator = Operator(kind, 6, num_operations=3 if dynamic else 0)
    with torch.no_grad():
        for param in operator.parameters():
            param.add_(torch.randn_like(param) * 0.3)
    params = {name: getattr(operator, name).detach().numpy() for name in operator.param_names}
    x = torch.randn(4, 6)
    for row in range(3) if dynamic else [None]:
        rel = torch.full((4,), row, dtype=torch.long) if row is not None else None
        with torch.no_grad():
            expected = operator(x, rel).numpy()
        got = apply_operator(kind, params, x.numpy(), row)
        assert np.allclose(got, expected, atol=1e-5), (kind, row)


@pytest.mark.parametrize("kind", names.COMPARATORS)
@pytest.mark.parametrize("bias", [False, True])
def test_numpy_comparators_match_torch(kind: str, bias: bool) -> None:
    torch.manual_seed(1)
    x, y = torch.randn(3, 5), torch.randn(4, 5)
    theirs, ours = Comparator(kind, bias), NumpyComparator(kind, bias)
    xp, yp = theirs.prepare(x), theirs.prepare(y)
    assert np.allclose(ours.prepare(x.numpy()), xp.numpy(), atol=1e-6)
    assert np.allclose(ours.pairwise(xp.numpy(), yp.numpy()), theirs.pairwise(xp, yp).numpy(), atol=1e-4)
    assert np.allclose(ours.pos(xp.numpy(), xp.numpy()[::-1].copy()), theirs.pos(xp, xp.flip(0)).numpy(), atol=1e-4)


def test_config_and_names_import_without_torch() -> None:
    code = (
        "import sys\nimport job.config\nimport job.model.registry, job.archive.scoring\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
