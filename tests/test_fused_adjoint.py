"""The operator moved onto the anchors (``job.model.fused_pair.fused_pair_adjoint``) trains as autograd does.

tests/test_fused.py already holds the fused path, this one included, to the autograd path for the
complex_diagonal, linear and translation operators; here the other operators (none, diagonal, affine),
negatives disabled on one side, and the facts the shortcut rests on: each operator's ``adjoint`` is the
transpose of its ``linear`` part, and the operator is applied to the positives only.
"""

from __future__ import annotations

import itertools
import os
import sys

import pytest
import torch

from job.model import fused_pair
from job.model.fused_pair import in_order
from job.model.kernel_options import KernelOptions
from job.model.names import OPERATORS
from job.model.operators import Operator

sys.path.insert(0, os.path.dirname(__file__))
from test_fused import TEST_DEVICE, _run, assert_fused_matches_autograd  # noqa: E402

NUM_POS = 57


def _compare(overrides: dict, num_entities: int) -> None:
    """One float64 batch through the fused path and the autograd path: same updates, sums and gradients."""
    assert_fused_matches_autograd(overrides, num_entities, NUM_POS, False)


@pytest.mark.parametrize("loss_fn,negs,num_entities,operator", list(itertools.product(
    ["softmax", "ranking", "logistic"], [(10, 10), (0, 7), (10, 200)], [30, 5000], ["none", "diagonal", "affine"])))
def test_adjoint_path_matches_autograd(loss_fn: str, negs: tuple[int, int], num_entities: int, operator: str) -> None:
    """30 entities: one gather for both sides and, with 200 draws, each row scored once and weighted."""
    _compare({"loss_fn": loss_fn, "comparator": "dot", "num_batch_negs": negs[0], "num_uniform_negs": negs[1],
              "operator": operator, "regularization_coef": 0.01 if operator == "affine" else 0.0}, num_entities)


@pytest.mark.parametrize("disabled,operator", list(itertools.product(
    ["disable_lhs_negs", "disable_rhs_negs"], ["affine", "complex_diagonal"])))
def test_adjoint_path_with_one_side_disabled(disabled: str, operator: str) -> None:
    _compare({"loss_fn": "softmax", "comparator": "dot", "num_batch_negs": 10, "num_uniform_negs": 20,
              "operator": operator, disabled: True}, 5000)


@pytest.mark.parametrize("kind", OPERATORS)
def test_adjoint_is_the_transpose_of_the_linear_part(kind: str) -> None:
    """<u, f(v)> = <L^T u, v> + <u, t>, and f(v) = L v + t, for random parameters."""
    torch.manual_seed(0)
    operator = Operator(kind, 6).double()
    with torch.no_grad():
        for param in operator.parameters():
            param.normal_()
        u, v = torch.randn(5, 6, dtype=torch.float64), torch.randn(5, 6, dtype=torch.float64)
        additive = operator.additive()
        shift = torch.zeros(5, dtype=torch.float64) if additive is None else u @ additive
        torch.testing.assert_close((u * operator(v)).sum(1), (operator.adjoint(u) * v).sum(1) + shift)
        torch.testing.assert_close(operator(v), operator.linear(v) + (0 if additive is None else additive))


@pytest.mark.parametrize("enabled", [True, False])
def test_operator_applied_to_the_positives_only(monkeypatch: pytest.MonkeyPatch, enabled: bool) -> None:
    """With the shortcut on, the rhs operator sees the batch's positives, never the ~N uniform draws."""
    rows_seen: list[int] = []
    forward = Operator.forward

    def spy(self: Operator, x: torch.Tensor, rel: torch.Tensor | None = None) -> torch.Tensor:
        rows_seen.append(x.shape[0])
        return forward(self, x, rel)

    monkeypatch.setattr(Operator, "forward", spy)
    overrides = {"loss_fn": "softmax", "comparator": "dot", "num_batch_negs": 10, "num_uniform_negs": 100,
                 "operator": "complex_diagonal"}
    _run(overrides, 5000, NUM_POS, False, fused=True, options=KernelOptions(operator_adjoint=enabled))
    assert rows_seen and (max(rows_seen) == NUM_POS) == enabled


def test_rows_in_order_are_recognised_and_nothing_else() -> None:
    """``in_order``: positives first in order, then the negatives one row per draw, and no other row."""
    inv = torch.arange(6)
    neg = torch.arange(6, 14).view(2, 4)
    assert in_order(14, inv, neg) == 6
    assert in_order(6, inv, None) == 6
    assert in_order(15, inv, neg) is None  # a row no one scores
    assert in_order(14, inv.flip(0), neg) is None  # positives out of order
    assert in_order(14, inv, neg.flip(1)) is None  # negatives out of order
    assert in_order(14, torch.arange(1, 7), neg - 1) is None  # positives not first
    assert in_order(10, inv, torch.zeros(2, 4, dtype=torch.long)) is None  # deduplicated draws


@pytest.mark.parametrize("loss_fn", ["softmax", "ranking"])
def test_every_occurrence_layout_writes_gradients_in_place(monkeypatch: pytest.MonkeyPatch, loss_fn: str) -> None:
    """A CPU batch of a large table takes the in-order layout on both sides (and still trains as autograd does,
    which the test above checks for the same shapes)."""
    if TEST_DEVICE.type != "cpu":
        pytest.skip("a CPU layout: on a GPU every batch takes the static-shape path")
    seen: list[int | None] = []

    def recording(num_rows: int, inv: torch.Tensor, neg_inv: torch.Tensor | None) -> int | None:
        seen.append(in_order(num_rows, inv, neg_inv))
        return seen[-1]

    monkeypatch.setattr(fused_pair, "in_order", recording)
    overrides = {"loss_fn": loss_fn, "comparator": "dot", "num_batch_negs": 10, "num_uniform_negs": 10,
                 "operator": "complex_diagonal"}
    assert_fused_matches_autograd(overrides, 5000, 57, False)
    assert seen == [57, 57]
