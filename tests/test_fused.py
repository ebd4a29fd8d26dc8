"""The hand-differentiated hot path gives autograd's losses and gradients.

``job.model.fused`` (negative scoring + loss) and the complex-diagonal operator replace autograd
for speed; each batch here is run twice from the same state, once through them and once through
the autograd path, in float64, and every updated embedding and operator gradient is compared.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from typing import Any

import pytest
import torch

import job.native as native
from job.config import parse_config
from job.model import deferred
from job.model import fused as fused_scoring
from job.model.kernel_options import KernelOptions
from job.model.operators import _ComplexDiagonal
from job.model.scoring import Model, Table
from job.train.batch.step import BatchContext, run_batch

DIM = 8
# BIGGRAPH_TEST_DEVICE=cuda runs the comparisons on the GPU (the ids are drawn on the CPU either way)
TEST_DEVICE = torch.device(os.environ.get("BIGGRAPH_TEST_DEVICE", "cpu"))


def _run(config_overrides: dict, num_entities: int, num_pos: int, dynamic: bool, fused: bool,
         device: torch.device = TEST_DEVICE, static: bool = False, compute_dtype: torch.dtype | None = None,
         dtype: torch.dtype = torch.float64, options: KernelOptions = KernelOptions()) -> tuple:
    """One trained batch from a fixed state in ``dtype``: (updated table, Adagrad sums, parameter gradients, stats).

    ``compute_dtype``: the reduced precision of the scores' products (``Model.compute_dtype``); ``options``: the
    step's kernels; ``static``: with the GPU's static-shape step on the CPU (``static_shapes_on_cpu``)."""
    if static:
        options = dataclasses.replace(options, static_shapes_on_cpu=True)
    raw = {
        "entities": {"node": {"num_partitions": 1}},
        "relations": [{"name": "r", "lhs": "node", "rhs": "node", "operator": config_overrides.pop("operator")}],
        "dimension": DIM, "entity_path": "x", "edge_paths": ["x"], "checkpoint_path": "x", "batch_size": 60,
        "lr": 0.1, "dynamic_relations": dynamic, "global_emb": not dynamic, **config_overrides,
    }
    config = parse_config(raw)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        torch.manual_seed(0)
        model = Model(config, 3 if dynamic else 0)
        assert model.fused == (config.comparator in ("dot", "cos") and not config.bias)
        model.fused = fused and model.fused
        model.compute_dtype = compute_dtype
        for param in model.parameters():
            param.data.normal_()
        model.to(device)
        weight = torch.randn(num_entities, DIM).to(device)
        table = Table(weight, torch.zeros(num_entities, device=device))
        ctx = BatchContext(config, model, None, {0: table}, {0: table}, config.num_batch_negs, config.num_uniform_negs,
                           options)
        generator = torch.Generator().manual_seed(1)
        lhs = torch.randint(0, num_entities, (num_pos,), generator=generator).to(device)
        rhs = torch.randint(0, num_entities, (num_pos,), generator=generator).to(device)
        rel = torch.randint(0, 3, (num_pos,), generator=generator).to(device) if dynamic else None
        stats = run_batch(ctx, 0, lhs, rhs, rel, generator=generator, train=True)
        grads = [None if p.grad is None else p.grad.clone().cpu() for p in model.parameters()]
        weight, optim_sum = weight.cpu(), table.optim_sum.cpu()
    finally:
        torch.set_default_dtype(previous)
    return weight, optim_sum, grads, stats


CASES = list(itertools.product(
    ["softmax", "ranking", "logistic"], ["dot", "cos"], [(10, 10), (0, 7), (10, 0), (10, 200)], [30, 5000],
    [False, True], ["complex_diagonal", "linear", "translation"],
))


def assert_fused_matches_autograd(overrides: dict, num_entities: int, num_pos: int, dynamic: bool,
                                  options: KernelOptions = KernelOptions()) -> tuple[Any, Any]:
    """One float64 batch through the fused path (with ``options``' kernels) and the autograd path: same updates,
    Adagrad sums, parameter gradients and loss. Returns both paths' stats (fused, reference) for further checks."""
    ref_weight, ref_sum, ref_grads, ref_stats = _run(dict(overrides), num_entities, num_pos, dynamic, fused=False)
    weight, optim_sum, grads, stats = _run(dict(overrides), num_entities, num_pos, dynamic, fused=True,
                                           options=options)
    torch.testing.assert_close(weight, ref_weight, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(optim_sum, ref_sum, rtol=1e-9, atol=1e-9)
    for got, want in zip(grads, ref_grads):
        assert (got is None) == (want is None)
        if got is not None:
            torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-7)
    assert float(stats.loss) == pytest.approx(float(ref_stats.loss), rel=1e-9)
    return stats, ref_stats


@pytest.mark.parametrize("loss_fn,comparator,negs,num_entities,dynamic,operator", CASES)
def test_fused_scoring_matches_autograd(loss_fn: str, comparator: str, negs: tuple[int, int], num_entities: int,
                                        dynamic: bool, operator: str) -> None:
    num_batch_negs, num_uniform_negs = negs
    overrides = {"loss_fn": loss_fn, "comparator": comparator, "num_batch_negs": num_batch_negs,
                 "num_uniform_negs": num_uniform_negs, "operator": operator,
                 "regularization_coef": 0.01 if operator == "linear" else 0.0}
    num_pos = 57  # not a multiple of the chunk: padding is exercised
    stats, ref_stats = assert_fused_matches_autograd(overrides, num_entities, num_pos, dynamic)
    assert float(stats.reg) == pytest.approx(float(ref_stats.reg), rel=1e-9)
    # violators can differ on exact ties only (a positive scored by the product it is part of, or not)
    tolerance = 0.1 if num_entities < 100 else 0.03
    assert float(stats.violators_lhs) == pytest.approx(float(ref_stats.violators_lhs), rel=tolerance, abs=3)
    assert float(stats.violators_rhs) == pytest.approx(float(ref_stats.violators_rhs), rel=tolerance, abs=3)


@pytest.mark.parametrize("loss_fn,comparator,negs,num_entities,dynamic",
                         [c[:5] for c in CASES if c[0] != "logistic" and c[5] == "complex_diagonal"])
def test_torch_form_of_the_side_loss_matches_autograd(loss_fn: str, comparator: str, negs: tuple[int, int],
                                                      num_entities: int, dynamic: bool) -> None:
    """The fused path with the side loss in torch ops (no C compiler, another dtype) rather than the native
    kernel, which the test above takes for softmax and ranking wherever the kernels load."""
    overrides = {"loss_fn": loss_fn, "comparator": comparator, "num_batch_negs": negs[0],
                 "num_uniform_negs": negs[1], "operator": "complex_diagonal"}
    assert_fused_matches_autograd(overrides, num_entities, 57, dynamic, KernelOptions(native_loss=False))


def test_the_native_side_loss_is_what_the_fused_path_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the kernels loaded, softmax and ranking never reach the torch form (``blockwise_loss``)."""
    if native.library() is None:
        pytest.skip("the native kernels did not load (no C compiler here): the torch form runs, tested above")

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the torch form of the side loss ran")

    monkeypatch.setattr(fused_scoring, "blockwise_loss", refuse)
    for loss_fn in ("softmax", "ranking"):
        overrides = {"loss_fn": loss_fn, "comparator": "dot", "num_batch_negs": 10, "num_uniform_negs": 10,
                     "operator": "complex_diagonal"}
        # on the CPU: a GPU run of this file (BIGGRAPH_TEST_DEVICE=cuda) takes the torch form, by design
        _run(dict(overrides), 5000, 57, False, fused=True, device=torch.device("cpu"))
        _run(dict(overrides), 30, 57, True, fused=True, device=torch.device("cpu"))


STATIC_CASES = [case for case in CASES if case[2] in ((10, 10), (10, 200))] + [
    ("ranking", "l2", (10, 10), 5000, False, "complex_diagonal"),
    ("logistic", "squared_l2", (10, 10), 30, True, "translation"),
    ("softmax", "dot", (10, 10), 5000, False, "linear", {"bias": True}),
    ("softmax", "cos", (10, 10), 30, False, "complex_diagonal", {"max_norm": 1.5}),
    ("softmax", "dot", (10, 10), 5000, False, "complex_diagonal", {"max_norm": 1.5}),
]


@pytest.mark.parametrize("case", STATIC_CASES, ids=str)
def test_static_shape_path_matches_the_unique_row_path(case: tuple) -> None:
    """The GPU's path (every occurrence gathered, repeated rows summed inside the Adagrad step) updates
    the tables exactly as deduplicating first does; run here on the CPU."""
    loss_fn, comparator, (num_batch_negs, num_uniform_negs), num_entities, dynamic, operator, *extra = case
    overrides = {"loss_fn": loss_fn, "comparator": comparator, "num_batch_negs": num_batch_negs,
                 "num_uniform_negs": num_uniform_negs, "operator": operator, **(extra[0] if extra else {})}
    ref_weight, ref_sum, ref_grads, ref_stats = _run(dict(overrides), num_entities, 57, dynamic, fused=True)
    weight, optim_sum, grads, stats = _run(dict(overrides), num_entities, 57, dynamic, fused=True, static=True)
    assert not torch.equal(weight, torch.zeros_like(weight))
    torch.testing.assert_close(optim_sum, ref_sum, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(weight, ref_weight, rtol=1e-9, atol=1e-12)
    for got, want in zip(grads, ref_grads):
        if got is not None:
            torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-9)
    assert float(stats.loss) == pytest.approx(float(ref_stats.loss), rel=1e-9)


def test_fused_path_is_taken_and_has_a_fallback() -> None:
    raw = {"entities": {"n": {"num_partitions": 1}}, "relations": [{"name": "r", "lhs": "n", "rhs": "n"}],
           "dimension": 4, "entity_path": "x", "edge_paths": ["x"], "checkpoint_path": "x"}
    assert Model(parse_config({**raw, "comparator": "dot"})).fused
    assert not Model(parse_config({**raw, "comparator": "l2"})).fused
    assert not Model(parse_config({**raw, "comparator": "dot", "bias": True})).fused


@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("conjugate", [False, True])
@pytest.mark.parametrize("use_native", [True, False])
def test_complex_diagonal_operator_gradients(monkeypatch: pytest.MonkeyPatch, per_row: bool, conjugate: bool,
                                             use_native: bool) -> None:
    """Forward and hand-written backward of x (re + i im) (or of the conjugate) are complex multiplication and
    its gradients (gradcheck in float64), through the native kernel and through torch ops alike."""
    if use_native and native.library() is None:
        pytest.skip("the native kernels did not load (no C compiler here): the torch form is tested")
    if not use_native:
        monkeypatch.setattr(native, "_loaded", {"lib": None})
    torch.manual_seed(0)
    x = torch.randn(7, 6, dtype=torch.float64, requires_grad=True)
    shape = (7, 3) if per_row else (3,)
    real = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    imag = torch.randn(shape, dtype=torch.float64, requires_grad=True)

    def apply(x: torch.Tensor, real: torch.Tensor, imag: torch.Tensor) -> torch.Tensor:
        return _ComplexDiagonal.apply(x, real, imag, conjugate)

    assert torch.autograd.gradcheck(apply, (x, real, imag))
    factor = torch.complex(real, -imag if conjugate else imag)
    product = torch.complex(x[:, :3], x[:, 3:]) * factor
    torch.testing.assert_close(apply(x, real, imag), torch.cat((product.real, product.imag), 1))


@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("conjugate", [False, True])
def test_complex_diagonal_native_float32_is_the_torch_form(monkeypatch: pytest.MonkeyPatch, per_row: bool,
                                                           conjugate: bool) -> None:
    """In float32 over a batch's worth of rows (the static parameters' gradient is a sum over all of them)."""
    if native.library() is None:
        pytest.skip("the native kernels did not load (no C compiler here)")
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(2000, 100, generator=generator)
    real = torch.randn((2000, 50) if per_row else (50,), generator=generator)
    imag = torch.randn(real.shape, generator=generator)
    grad = torch.randn(2000, 100, generator=generator)
    results = []
    for loaded in (None, {"lib": None}):
        if loaded is not None:
            monkeypatch.setattr(native, "_loaded", loaded)
        leaves = [t.clone().requires_grad_(True) for t in (x, real, imag)]
        out = _ComplexDiagonal.apply(*leaves, conjugate)
        out.backward(grad)
        results.append([out.detach(), *(leaf.grad for leaf in leaves)])
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("fused", [False, True])
def test_rows_on_both_sides_get_one_merged_adagrad_step(monkeypatch: pytest.MonkeyPatch, fused: bool) -> None:
    """Per-side gathers (large tables) must update a row used by both sides exactly as one joint gather does."""
    from job.train.batch import step

    raw = {"entities": {"node": {"num_partitions": 1}},
           "relations": [{"name": "r", "lhs": "node", "rhs": "node", "operator": "complex_diagonal"}],
           "dimension": DIM, "entity_path": "x", "edge_paths": ["x"], "checkpoint_path": "x", "batch_size": 60,
           "num_batch_negs": 10, "num_uniform_negs": 10, "lr": 0.1}
    config = parse_config(raw)
    results = []
    for rows_per_edge in (0, 10**9):  # per-side gathers, then one joint gather
        monkeypatch.setattr(step, "JOINT_GATHER_ROWS_PER_EDGE", rows_per_edge)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            torch.manual_seed(0)
            model = Model(config)
            model.fused = fused
            weight = torch.randn(5000, DIM)
            table = Table(weight, torch.zeros(5000))
            ctx = BatchContext(config, model, None, {0: table}, {0: table}, 10, 10)
            generator = torch.Generator().manual_seed(1)
            # positives from 40 rows: most rows are on both sides; uniform negatives reach the rest
            lhs = torch.randint(0, 40, (57,), generator=generator)
            rhs = torch.randint(0, 40, (57,), generator=generator)
            run_batch(ctx, 0, lhs, rhs, None, generator=generator, train=True)
        finally:
            torch.set_default_dtype(previous)
        results.append((weight, table.optim_sum))
    (split_weight, split_sum), (joint_weight, joint_sum) = results
    assert not torch.equal(split_weight, torch.zeros_like(split_weight))
    torch.testing.assert_close(split_sum, joint_sum, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(split_weight, joint_weight, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("loss_fn,comparator,negs,dynamic,operator", [
    ("softmax", "dot", (10, 200), True, "complex_diagonal"), ("ranking", "cos", (10, 200), False, "translation"),
    ("softmax", "dot", (0, 7), False, "linear"), ("logistic", "dot", (10, 0), True, "complex_diagonal"),
])
@pytest.mark.parametrize("fused", [True, False])
def test_every_occurrence_on_the_cpu_updates_as_the_unique_rows_do(loss_fn: str, comparator: str, negs: tuple,
                                                                   dynamic: bool, operator: str, fused: bool) -> None:
    """A large table's batch gathered once per occurrence (negatives scored in place, repeats merged before the
    Adagrad step) gives the same update as deduplicated rows, in float64; 1,200 draws from 300-5,000 rows
    repeat, within a side and across sides."""
    for num_entities in (300, 5000):
        results = {}
        for occurrences in (True, False):
            overrides = {"loss_fn": loss_fn, "comparator": comparator, "num_batch_negs": negs[0],
                         "num_uniform_negs": negs[1], "operator": operator}
            results[occurrences] = _run(overrides, num_entities, 57, dynamic, fused,
                                        options=KernelOptions(occurrences_on_cpu=occurrences))
        (weight, optim_sum, _, _), (ref_weight, ref_sum, _, _) = results[True], results[False]
        assert ref_sum.count_nonzero() > 0  # the batch did update rows
        torch.testing.assert_close(weight, ref_weight, rtol=0, atol=1e-9)
        torch.testing.assert_close(optim_sum, ref_sum, rtol=0, atol=1e-9)


@pytest.mark.parametrize("loss_fn,comparator,negs,operator,reg", [
    ("softmax", "dot", (10, 200), "complex_diagonal", 0.0), ("ranking", "cos", (10, 40), "translation", 0.0),
    ("logistic", "dot", (0, 30), "linear", 0.01), ("softmax", "dot", (10, 0), "diagonal", 0.01),
])
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("num_entities,static", [(40, False), (5000, False), (5000, True)])
def test_positives_gathered_off_autograd_update_as_autograd_does(loss_fn: str, comparator: str, negs: tuple,
                                                                 operator: str, reg: float, fused: bool,
                                                                 num_entities: int, static: bool) -> None:
    """Reciprocal scoring gathers the positives as their own leaf and adds their gradient to the rows' after
    backward (job.model.deferred): the same update, relation gradients and loss as autograd's gather, in
    float64, with the N3 regulariser on the positives; 57 edges over 40 rows (one joint gather, positives
    repeating), over 5,000 (each side its own rows: every occurrence on the CPU) and the GPU's static shapes."""
    results = {}
    for enabled in (True, False):
        overrides = {"loss_fn": loss_fn, "comparator": comparator, "num_batch_negs": negs[0],
                     "num_uniform_negs": negs[1], "operator": operator, "regularization_coef": reg}
        results[enabled] = _run(overrides, num_entities, 57, True, fused, static=static,
                                options=KernelOptions(deferred_positives=enabled))
    (weight, optim_sum, grads, stats), (ref_weight, ref_sum, ref_grads, ref_stats) = results[True], results[False]
    assert ref_sum.count_nonzero() > 0
    torch.testing.assert_close(weight, ref_weight, rtol=0, atol=1e-10)
    torch.testing.assert_close(optim_sum, ref_sum, rtol=0, atol=1e-10)
    for grad, ref in zip(grads, ref_grads):
        assert (grad is None) == (ref is None)
        if grad is not None:
            torch.testing.assert_close(grad, ref, rtol=0, atol=1e-10)
    # the stats stay on the batch's device until the bucket ends (no host synchronisation per batch)
    assert float(stats.loss) == pytest.approx(float(ref_stats.loss), rel=1e-12)


def test_a_deferred_merge_creates_the_rows_gradient_when_nothing_else_reached_them() -> None:
    rows = torch.zeros(5, 3, dtype=torch.float64, requires_grad=True)
    positives, pending = deferred.gather_positives(rows, torch.tensor([4, 1, 4]), True)
    assert pending is not None and positives.is_leaf
    positives.sum().backward()
    assert rows.grad is None  # autograd did not reach the rows: the merge does
    pending.merge()
    assert rows.grad is not None
    torch.testing.assert_close(rows.grad[:, 0], torch.tensor([0.0, 1.0, 0.0, 0.0, 2.0], dtype=torch.float64))
    with torch.no_grad():
        _, none = deferred.gather_positives(rows, torch.tensor([0]), True)
    assert none is None  # evaluation gathers through the usual path
    _, off = deferred.gather_positives(rows, torch.tensor([0]), False)
    assert off is None  # ``deferred_positives`` off: through autograd
