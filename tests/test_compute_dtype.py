"""``compute_dtype``: the training step's products in bfloat16 stay close to float64, the state stays float32.

Tolerances. bfloat16 keeps 8 significant bits (a relative rounding error of 2^-9 ~ 0.2% per input),
and a score sums DIM such products, so scores are off by ~0.5% of their size. Where the loss is
smooth (softmax, logistic) that carries into the gradients and the updates at about 1% (measured:
at most 0.94% over every case below); the Adagrad sums are squares of gradients summed over rows, 2.7%
at worst. The ranking loss is a hinge: a negative within rounding of the margin switches on or off,
which moves its row's whole gradient, so its gradients and updates are held to 15% (measured 7.4%).
The loss itself is a sum of many such terms and stays within 0.12% for every loss.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import pytest
import torch

from job.config import ConfigKeyError, parse_config
from job.evaluation import evaluate
from job.train import Trainer, train
from job.train.batch import precision
from job.train.batch.precision import training_dtype

sys.path.insert(0, os.path.dirname(__file__))
from helpers_graphs import pass_losses, write_cycle_graph  # noqa: E402
from test_fused import CASES, STATIC_CASES, _run  # noqa: E402

LOSS_TOLERANCE = 5e-3
# (gradients and updates, Adagrad sums), relative to their norm
SMOOTH_TOLERANCE = (0.03, 0.06)
HINGE_TOLERANCE = (0.15, 0.10)


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def _overrides(loss_fn: str, comparator: str, negs: tuple[int, int], operator: str) -> dict:
    return {"loss_fn": loss_fn, "comparator": comparator, "num_batch_negs": negs[0], "num_uniform_negs": negs[1],
            "operator": operator, "regularization_coef": 0.01 if operator == "linear" else 0.0}


def _product_dtypes(monkeypatch: pytest.MonkeyPatch) -> set[torch.dtype]:
    """The dtypes of the matrix products run from now on (torch.bmm, matmul, mm called from Python)."""
    seen: set[torch.dtype] = set()
    for name in ("bmm", "matmul", "mm"):
        def spy(first: torch.Tensor, *args: object, _product=getattr(torch, name), **kwargs: object) -> torch.Tensor:
            seen.add(first.dtype)
            return _product(first, *args, **kwargs)
        monkeypatch.setattr(torch, name, spy)
    return seen


def _assert_close_to_float64(overrides: dict, num_entities: int, dynamic: bool, fused: bool,
                             monkeypatch: pytest.MonkeyPatch, static: bool = False) -> None:
    """One batch with bfloat16 products against the float64 autograd reference, from the same state."""
    before = _run({**overrides, "lr": 1e-30}, num_entities, 57, dynamic, fused=False)[0]
    ref_weight, ref_sum, ref_grads, ref_stats = _run(dict(overrides), num_entities, 57, dynamic, fused=False)
    with monkeypatch.context() as patch:
        products = _product_dtypes(patch)
        weight, optim_sum, grads, stats = _run(dict(overrides), num_entities, 57, dynamic, fused=fused,
                                               static=static, compute_dtype=torch.bfloat16)
    assert torch.bfloat16 in products  # the scores' products ran in bfloat16
    assert weight.dtype == optim_sum.dtype == torch.float64  # the state stays in its own dtype
    update_tol, sum_tol = HINGE_TOLERANCE if overrides["loss_fn"] == "ranking" else SMOOTH_TOLERANCE
    assert float(stats.loss) == pytest.approx(float(ref_stats.loss), rel=LOSS_TOLERANCE)
    assert _relative(weight - before, ref_weight - before) < update_tol
    assert _relative(optim_sum, ref_sum) < sum_tol
    for got, want in zip(grads, ref_grads):
        assert (got is None) == (want is None)
        if want is not None and want.norm() > 0:
            assert _relative(got, want) < update_tol


@pytest.mark.parametrize("loss_fn,comparator,negs,num_entities,dynamic,operator", CASES)
def test_bfloat16_fused_path_stays_close_to_float64(loss_fn: str, comparator: str, negs: tuple[int, int],
                                                    num_entities: int, dynamic: bool, operator: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    _assert_close_to_float64(_overrides(loss_fn, comparator, negs, operator), num_entities, dynamic, True, monkeypatch)


AUTOGRAD_CASES = [
    (loss_fn, comparator, negs, num_entities, extra)
    for loss_fn in ("softmax", "ranking", "logistic")
    for comparator, extra in (("dot", {}), ("cos", {}), ("l2", {}), ("squared_l2", {}), ("dot", {"bias": True}))
    for negs, num_entities in (((10, 10), 5000), ((10, 200), 30))
]


@pytest.mark.parametrize("loss_fn,comparator,negs,num_entities,extra", AUTOGRAD_CASES, ids=str)
def test_bfloat16_autograd_path_stays_close_to_float64(loss_fn: str, comparator: str, negs: tuple[int, int],
                                                       num_entities: int, extra: dict,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparators the fused path does not serve (and ``dot``/``cos`` without it) take bfloat16 products too."""
    overrides = {**_overrides(loss_fn, comparator, negs, "complex_diagonal"), **extra}
    _assert_close_to_float64(overrides, num_entities, False, False, monkeypatch)


@pytest.mark.parametrize("case", [case for case in STATIC_CASES if len(case) == 6][::3], ids=str)
def test_bfloat16_static_shape_path_stays_close_to_float64(case: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU's static-shape path (the one CUDA graphs capture), run on the CPU."""
    loss_fn, comparator, negs, num_entities, dynamic, operator = case
    _assert_close_to_float64(_overrides(loss_fn, comparator, negs, operator), num_entities, dynamic, True,
                             monkeypatch, static=True)


@pytest.mark.parametrize("static", [False, True])
def test_embeddings_gradients_and_adagrad_state_stay_float32(static: bool) -> None:
    overrides = _overrides("softmax", "dot", (10, 200), "complex_diagonal")
    weight, optim_sum, grads, stats = _run(dict(overrides), 5000, 57, False, fused=True, static=static,
                                           compute_dtype=torch.bfloat16, dtype=torch.float32)
    ref_weight = _run(dict(overrides), 5000, 57, False, fused=True, static=static, dtype=torch.float32)[0]
    assert weight.dtype == torch.float32 and optim_sum.dtype == torch.float32
    assert all(grad.dtype == torch.float32 for grad in grads if grad is not None)
    assert torch.isfinite(weight).all() and float(optim_sum.sum()) > 0
    assert not torch.equal(weight, ref_weight)  # the products ran in bfloat16
    torch.testing.assert_close(weight, ref_weight, rtol=0.0, atol=0.05)


def _learned_mrr(tmp_path: Path, **extra: object) -> tuple[list[float], float]:
    raw = write_cycle_graph(tmp_path, num_epochs=30, loss_fn="softmax", comparator="dot", **extra)
    config = parse_config(raw)
    train(config)
    metrics = evaluate(config, filter_paths=[raw["edge_paths"][0]], candidates="all")
    return pass_losses(config.checkpoint_path), metrics["mrr"]


def test_a_bfloat16_run_learns_as_a_float32_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a CPU without AVX512-BF16/AMX refuses bfloat16 (too slow emulated); the run's behaviour is the same there
    monkeypatch.setattr(precision, "_cpu_has", lambda name: name == "bfloat16")
    losses, mrr = _learned_mrr(tmp_path / "bf16", compute_dtype="bfloat16")
    _, mrr_float32 = _learned_mrr(tmp_path / "fp32")
    assert losses[-1] < losses[0] * 0.5, losses
    # random scores give MRR ~ H(40)/40 = 0.11 (see test_train_learning.test_training_learns_the_graph)
    assert mrr > 0.25 and mrr > mrr_float32 - 0.05, (mrr, mrr_float32)


CONFIG = {"entities": {"n": {"num_partitions": 1}}, "relations": [{"name": "r", "lhs": "n", "rhs": "n"}],
          "dimension": 4, "entity_path": "x", "edge_paths": ["x"], "checkpoint_path": "x"}
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_an_unknown_dtype_is_a_config_error() -> None:
    with pytest.raises(ConfigKeyError, match="config key 'compute_dtype': unknown value 'bf16' "
                                             r"\(expected one of float32, bfloat16, float16, auto\)"):
        parse_config({**CONFIG, "compute_dtype": "bf16"})


@pytest.mark.parametrize("native", [False, True])
def test_auto_is_bfloat16_where_native_else_float32(monkeypatch: pytest.MonkeyPatch, native: bool) -> None:
    monkeypatch.setattr(precision, "_cpu_has", lambda name: native and name == "bfloat16")
    expected = torch.bfloat16 if native else None
    assert training_dtype(parse_config({**CONFIG, "compute_dtype": "auto"}), CPU) == expected


def test_a_dtype_the_device_cannot_do_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(precision, "_cpu_has", lambda name: name == "bfloat16")
    monkeypatch.setattr(precision, "_cuda_has", lambda name: name == "float16")
    assert training_dtype(parse_config({**CONFIG, "compute_dtype": "bfloat16"}), CPU) == torch.bfloat16
    with pytest.raises(ConfigKeyError, match=r"'compute_dtype': this CPU has no native float16 kernels .*AVX512-FP16"
                                             r".*use 'float32' or 'bfloat16'"):
        training_dtype(parse_config({**CONFIG, "compute_dtype": "float16"}), CPU)
    with pytest.raises(ConfigKeyError, match=r"'compute_dtype': this GPU has no native bfloat16 kernels .*Ampere"):
        training_dtype(parse_config({**CONFIG, "compute_dtype": "bfloat16"}), CUDA)
    assert training_dtype(parse_config({**CONFIG, "compute_dtype": "float32"}), CUDA) is None


def test_the_cli_refuses_a_dtype_the_cpu_cannot_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture) -> None:
    from job.cli import main

    monkeypatch.setattr(precision, "_cpu_has", lambda name: False)
    path = tmp_path / "config.json"
    # on the CPU whatever BIGGRAPH_TEST_DEVICE says: a GPU with bfloat16 kernels would rightly train
    path.write_text(json.dumps(write_cycle_graph(tmp_path, compute_dtype="bfloat16", device="cpu")))
    code = main(["train", str(path)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "compute_dtype" in err and "no native bfloat16 kernels" in err and "Traceback" not in err


def test_half_precision_means_a_reduced_dtype_on_a_gpu_only(monkeypatch: pytest.MonkeyPatch,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    half = parse_config({**CONFIG, "half_precision": True})
    with caplog.at_level(logging.WARNING, logger="biggraph"):
        assert training_dtype(half, CPU) is None
    assert "half_precision is ignored on the CPU" in caplog.text and "compute_dtype: bfloat16" in caplog.text
    monkeypatch.setattr(precision, "_cpu_has", lambda name: True)
    assert training_dtype(parse_config({**CONFIG, "half_precision": True, "compute_dtype": "bfloat16"}),
                          CPU) == torch.bfloat16  # asked for explicitly, the CPU computes in it
    monkeypatch.setattr(precision, "_cuda_has", lambda name: True)
    assert training_dtype(half, CUDA) == torch.bfloat16
    monkeypatch.setattr(precision, "_cuda_has", lambda name: name == "float16")
    assert training_dtype(half, CUDA) == torch.float16  # a card before Ampere
    # an explicit compute_dtype wins over half_precision
    assert training_dtype(parse_config({**CONFIG, "half_precision": True, "compute_dtype": "float32"}), CUDA) is None
    assert training_dtype(parse_config(CONFIG), CUDA) is None


def test_the_trainer_hands_the_dtype_to_its_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(precision, "_cpu_has", lambda name: True)
    trainer = Trainer(parse_config(write_cycle_graph(tmp_path, compute_dtype="bfloat16")))
    try:
        assert trainer.model.compute_dtype == torch.bfloat16
        assert all(param.dtype == torch.float32 for param in trainer.model.parameters())
    finally:
        trainer.close()
