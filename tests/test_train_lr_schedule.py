"""The learning-rate schedule (``lr_decay``, ``lr_plateau_factor`` / ``lr_plateau_patience``; issue #33).

The rate of a pass is a function of its epoch and of the checkpoint's validation lines (job/train/lr_schedule.py):
unit tests hold the function to hand-worked values; training runs show that every optimizer takes it, the Hogwild
workers included (``lr_decay: 0`` leaves epoch 2 nothing to change), that a resumed run goes on with the decayed or
reduced rate, and the config refuses values out of range naming the key.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from job.config import parse_config
from job.errors import ConfigError
from job.formats.checkpoint import CheckpointStorage
from job.train import train
from job.train.bucket_run import BucketRunner
from job.train.hogwild.pool import WorkerPool
from job.train.lr_schedule import lr_scale, plateau_reductions

sys.path.insert(0, str(Path(__file__).parent))
from helpers_graphs import TEST_DEVICE, assert_same_run, write_cycle_graph  # noqa: E402


def _config(**keys: Any):
    return parse_config({
        "entities": {"e": {"num_partitions": 1}},
        "relations": [{"name": "r", "lhs": "e", "rhs": "e", "all_negs": True}],
        "dimension": 4, "entity_path": "x", "edge_paths": ["x"], "checkpoint_path": "x", "loss_fn": "softmax",
        **keys,
    })


def _line(version: int, mrr: float) -> dict[str, Any]:
    return {"validation": True, "checkpoint_version": version, "epoch_idx": version - 1, "metrics": {"mrr": mrr}}


# the rate of a pass --------------------------------------------------------------------------------------------


def test_off_by_default_is_exactly_one() -> None:
    config = _config()
    assert config.lr_decay == 1.0 and config.lr_plateau_factor == 1.0
    assert lr_scale(config, 7, [_line(1, 0.5), _line(2, 0.1), _line(3, 0.1)], 3) == 1.0


def test_decay_per_epoch() -> None:
    config = _config(lr_decay=0.5)
    assert [lr_scale(config, epoch) for epoch in range(4)] == [1.0, 0.5, 0.25, 0.125]
    assert lr_scale(_config(lr_decay=0), 0) == 1.0 and lr_scale(_config(lr_decay=0), 1) == 0.0


def test_plateau_counts_validations_without_improvement_and_restarts_after_a_reduction() -> None:
    lines = [_line(1, 0.1), _line(2, 0.2), _line(3, 0.15), _line(4, 0.15),  # two without improvement: 1st
             _line(5, 0.18),  # below the best 0.2, but the count restarted: 1 of 2
             _line(6, 0.3), _line(7, 0.2), _line(8, 0.25)]  # 0.3 resets; two more without improvement: 2nd
    assert plateau_reductions(lines, patience=2) == 2
    assert plateau_reductions(lines, patience=2, up_to_version=7) == 1  # lines past the version do not count
    assert plateau_reductions(lines, patience=1) == 5
    assert plateau_reductions([{"pass_summary": True}, *lines[:2]], patience=1) == 0  # other records ignored
    config = _config(lr_decay=0.9, lr_plateau_factor=0.5, lr_plateau_patience=2, validation_edge_paths=["v"])
    assert lr_scale(config, 3, lines, 8) == pytest.approx(0.9 ** 3 * 0.25)


# the config -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("keys", "fragments"), [
    ({"lr_decay": -0.1}, ("'lr_decay'", "[0, 1]", "-0.1")),
    ({"lr_decay": 1.5}, ("'lr_decay'", "[0, 1]")),
    ({"lr_plateau_factor": 0.0, "validation_edge_paths": ["v"]}, ("'lr_plateau_factor'", "(0, 1]")),
    ({"lr_plateau_factor": 2.0}, ("'lr_plateau_factor'", "(0, 1]")),
    ({"lr_plateau_patience": 0}, ("'lr_plateau_patience'", "positive integer")),
    ({"lr_plateau_factor": 0.5}, ("'lr_plateau_factor'", "validation_edge_paths")),
    ({"lr_plateau_factor": 0.5, "lr_plateau_patience": 2, "validation_edge_paths": ["v"], "early_stopping": True,
      "early_stopping_patience": 2}, ("'lr_plateau_patience'", "early_stopping_patience")),
    ({"label_smoothing": 1.0}, ("'label_smoothing'", "[0, 1)")),
    ({"label_smoothing": -0.1}, ("'label_smoothing'", "[0, 1)")),
    ({"label_smoothing": 0.1, "loss_fn": "ranking"}, ("'label_smoothing'", "loss_fn", "'ranking'")),
    ({"label_smoothing": 0.1, "relations": [{"name": "r", "lhs": "e", "rhs": "e"}]},
     ("'relations[0].all_negs'", "label_smoothing")),
])
def test_refusals_name_the_key(keys: dict[str, Any], fragments: tuple[str, ...]) -> None:
    with pytest.raises(ConfigError) as info:
        _config(**keys)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


def test_accepted_values() -> None:
    config = _config(lr_decay=0, lr_plateau_factor=0.5, lr_plateau_patience=1, validation_edge_paths=["v"],
                     early_stopping=True, early_stopping_patience=3, label_smoothing=0.2)
    assert (config.lr_decay, config.lr_plateau_factor, config.label_smoothing) == (0, 0.5, 0.2)
    for key in ("lr_decay", "lr_plateau_factor", "lr_plateau_patience", "label_smoothing"):
        assert key not in config.to_pbg_dict()  # PBG 1.0.0 refuses keys it does not know


# training runs --------------------------------------------------------------------------------------------------


def _arrays(checkpoint_path: str, version: int) -> dict[str, np.ndarray]:
    storage = CheckpointStorage(checkpoint_path)
    embeddings, _ = storage.load_entity_partition(version, "node", 0)
    params, _, _ = storage.load_model(version)
    return {"node": embeddings, **params}


@pytest.mark.skipif(TEST_DEVICE == "cuda", reason="Hogwild workers train on the CPU only")
@pytest.mark.parametrize("variant", [
    {},
    {"entity_optimizer": "adagrad"},
    # 1-vs-all softmax (the fused path), with label smoothing, per-coordinate Adagrad for the relations' copies
    {"preset": "quality", "operator": "complex_diagonal", "label_smoothing": 0.1},
])
def test_workers_train_at_the_decayed_rate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           variant: dict[str, Any]) -> None:
    """``lr_decay: 0``: epoch 2 trains at rate 0 in the Hogwild workers, so no row and no relation parameter moves;
    the same run without decay moves them. Epoch 2 runs in a resumed process, so the rate comes from the epoch."""
    calls: list[float] = []
    original = WorkerPool.run

    def spy(self: WorkerPool, *args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs.get("lr_scale", 1.0))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(WorkerPool, "run", spy)
    variant = dict(variant)
    operator = variant.pop("operator", None)
    moved = {}
    for decay in (0.0, 1.0):
        raw = write_cycle_graph(tmp_path / f"decay{decay}", num_epochs=2, workers=2, lr_decay=decay, **variant)
        if operator is not None:
            for relation in raw["relations"]:
                relation["operator"] = operator
        config = parse_config(raw)
        calls.clear()
        train(config, stop_after_iterations=1)
        after_one = _arrays(config.checkpoint_path, 1)
        train(config)
        after_two = _arrays(config.checkpoint_path, 2)
        # the pool trained each epoch's one bucket, told the rate's factor (epoch 2's in the resumed process)
        assert calls == [1.0, decay], calls
        moved[decay] = [name for name in after_one if not np.array_equal(after_one[name], after_two[name])]
    assert moved[0.0] == []
    assert "node" in moved[1.0] and len(moved[1.0]) > 1  # the rows and relation parameters of the undecayed run


def _fake_validation(monkeypatch: pytest.MonkeyPatch, mrr_of_version: dict[int, float]) -> None:
    """Validation scores chosen per version (what the schedule reads), without ranking anything."""
    import job.evaluation

    def evaluate(config: Any, *, filter_paths: Any = None, candidates: Any = None, version: int = 0) -> dict:
        return {"mrr": mrr_of_version[version], "hits@1": 0.0, "hits@10": 0.0, "count": 1, "protocol": "all",
                "filtered": True, "seconds": 0.0, "num_ranks": 1}

    monkeypatch.setattr(job.evaluation, "evaluate", evaluate)


def _scales(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    seen: list[float] = []
    original = BucketRunner.set_lr_scale

    def spy(self: BucketRunner, scale: float) -> None:
        seen.append(scale)
        original(self, scale)

    monkeypatch.setattr(BucketRunner, "set_lr_scale", spy)
    return seen


def test_plateau_reduces_after_validations_without_improvement_and_a_resumed_run_goes_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_validation(monkeypatch, {1: 0.5, 2: 0.4, 3: 0.3, 4: 0.6, 5: 0.55})
    scales = _scales(monkeypatch)
    keys = {"num_epochs": 5, "lr_plateau_factor": 0.5, "lr_plateau_patience": 1, "lr_decay": 0.9}
    raw = write_cycle_graph(tmp_path / "straight", **keys)
    straight = parse_config({**raw, "validation_edge_paths": raw["edge_paths"]})
    train(straight)
    expected = [1.0, 0.9, 0.81 * 0.5, 0.9 ** 3 * 0.25, 0.9 ** 4 * 0.25]
    assert scales == pytest.approx(expected)
    # stopped after 3 passes (validations of versions 1-3 on disk), then resumed in a new trainer
    raw = write_cycle_graph(tmp_path / "resumed", **keys)
    resumed = parse_config({**raw, "validation_edge_paths": raw["edge_paths"]})
    scales.clear()
    train(resumed, stop_after_iterations=3)
    train(resumed)
    assert scales == pytest.approx(expected)
    a, b = _arrays(straight.checkpoint_path, 5), _arrays(resumed.checkpoint_path, 5)
    for name in a:
        assert_same_run(a[name], b[name])


def test_resumed_decay_continues_exactly(tmp_path: Path) -> None:
    """A run stopped after 2 of 4 epochs and resumed ends where the uninterrupted one does, and not where a run
    whose schedule restarted at the resume (or had no decay) would."""
    runs = {}
    for name, keys in (("straight", {"lr_decay": 0.5}), ("resumed", {"lr_decay": 0.5}), ("restarted", {}),
                       ("none", {})):
        config = parse_config(write_cycle_graph(tmp_path / name, num_epochs=4, **keys))
        if name == "resumed":
            train(config, stop_after_iterations=2)
        if name == "restarted":  # two epochs at 0.5 ** e, then two at the configured rate (a schedule kept in memory)
            train(parse_config(write_cycle_graph(tmp_path / name, num_epochs=2, lr_decay=0.5)))
            config = parse_config(write_cycle_graph(tmp_path / name, num_epochs=4, lr_decay=1.0))
        train(config)
        runs[name] = _arrays(config.checkpoint_path, 4)
    for name in runs["straight"]:
        assert_same_run(runs["straight"][name], runs["resumed"][name])
    assert not np.allclose(runs["straight"]["node"], runs["restarted"]["node"])
    assert not np.allclose(runs["straight"]["node"], runs["none"]["node"])
