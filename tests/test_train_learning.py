"""Training learns: every operator/comparator/loss lowers the loss, the cycle graph is learnt, Hogwild
workers train together, featurized entities train as the mean of their features."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from job.config import parse_config
from job.evaluation import evaluate
from job.formats.checkpoint import CheckpointStorage
from job.formats.edges import edges_file, write_edges
from job.formats.entities import write_entity_count
from job.train import train

sys.path.insert(0, str(Path(__file__).parent))
from helpers_graphs import TEST_DEVICE, pass_losses, write_cycle_graph  # noqa: E402

# learning -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides",
    [
        {"comparator": "dot", "loss_fn": "softmax"},
        {"comparator": "cos", "loss_fn": "ranking"},
        {"comparator": "l2", "loss_fn": "logistic"},
        {"comparator": "squared_l2", "loss_fn": "ranking", "margin": 1.0},
        {"comparator": "dot", "loss_fn": "logistic", "bias": True},
        {"comparator": "dot", "loss_fn": "softmax", "operator": "diagonal"},
        {"comparator": "dot", "loss_fn": "softmax", "operator": "linear"},
        {"comparator": "dot", "loss_fn": "softmax", "operator": "affine"},
        {"comparator": "dot", "loss_fn": "softmax", "operator": "complex_diagonal"},
        {"comparator": "dot", "loss_fn": "softmax", "operator": "none"},
        {"comparator": "dot", "loss_fn": "softmax", "num_batch_negs": 0},
        {"comparator": "dot", "loss_fn": "softmax", "num_uniform_negs": 0},
        {"comparator": "dot", "loss_fn": "softmax", "disable_lhs_negs": True},
        {"comparator": "dot", "loss_fn": "softmax", "all_negs": True},
        {"comparator": "cos", "loss_fn": "softmax", "max_norm": 1.0},
        {"comparator": "dot", "loss_fn": "softmax", "regularization_coef": 1e-3},
        {"comparator": "dot", "loss_fn": "softmax", "dynamic": True, "operator": "complex_diagonal"},
        {"comparator": "dot", "loss_fn": "softmax", "dynamic": True, "operator": "linear"},
    ],
    ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()),
)
def test_loss_decreases_and_gradients_stay_finite(tmp_path: Path, overrides: dict[str, Any]) -> None:
    overrides = dict(overrides)
    operator = overrides.pop("operator", None)
    all_negs = overrides.pop("all_negs", False)
    dynamic = overrides.pop("dynamic", False)
    raw = write_cycle_graph(tmp_path, dynamic=dynamic, **overrides)
    for relation in raw["relations"]:
        if operator:
            relation["operator"] = operator
        relation["all_negs"] = all_negs
    config = parse_config(raw)
    train(config)
    losses = pass_losses(config.checkpoint_path)
    assert len(losses) == config.num_epochs
    assert all(np.isfinite(losses))
    assert losses[-1] < losses[0] * 0.9, losses
    storage = CheckpointStorage(config.checkpoint_path)
    embeddings, _ = storage.load_entity_partition(storage.load_version(), "node", 0)
    assert np.isfinite(embeddings).all()


def test_training_learns_the_graph(tmp_path: Path) -> None:
    raw = write_cycle_graph(tmp_path, num_epochs=30, loss_fn="softmax", comparator="dot")
    config = parse_config(raw)
    train(config)
    metrics = evaluate(config, filter_paths=[raw["edge_paths"][0]], candidates="all")
    assert metrics["count"] == 80
    # random scores would give MRR ~ H(40)/40 = 0.11 and hits@10 = 0.25
    assert metrics["mrr"] > 0.25, metrics
    assert metrics["hits@10"] > 0.8, metrics


@pytest.mark.slow
def test_hogwild_workers_train_together(tmp_path: Path) -> None:
    raw = write_cycle_graph(tmp_path, num_entities=400, num_relations=3, num_epochs=4, workers=2, batch_size=50,
                            num_batch_negs=10)
    config = parse_config(raw)
    train(config)
    losses = pass_losses(config.checkpoint_path)
    assert losses[-1] < losses[0] * 0.9
    stats = CheckpointStorage(config.checkpoint_path).load_stats()
    assert sum(s["stats"]["count"] for s in stats if s.get("pass_summary")) == 4 * 1200


# featurized entities --------------------------------------------------------------------------------------


def write_featurized_graph(root: Path, num_features: int = 30, num_items: int = 40, num_edges: int = 600) -> dict[str, Any]:
    """Users are bags of 1-3 features (PBG's lhsd tensor lists); an edge goes to the item of its first feature."""
    rng = np.random.default_rng(1)
    entity_path = root / "entities"
    write_entity_count(str(entity_path), "user", 0, num_features)
    write_entity_count(str(entity_path), "item", 0, num_items)
    lengths = rng.integers(1, 4, num_edges)
    offsets = np.concatenate(([0], np.cumsum(lengths)))
    data = rng.integers(0, num_features, int(offsets[-1]))
    rhs = data[offsets[:-1]] % num_items
    write_edges(edges_file(str(root / "edges"), 0, 0), np.zeros(num_edges, np.int64), np.full(num_edges, -1),
                rhs, lhsd=(offsets, data))
    return {
        "entities": {"user": {"num_partitions": 1, "featurized": True}, "item": {"num_partitions": 1}},
        "relations": [{"name": "likes", "lhs": "user", "rhs": "item", "operator": "diagonal"}],
        "dimension": 16, "comparator": "dot", "loss_fn": "softmax", "entity_path": str(entity_path),
        "edge_paths": [str(root / "edges")], "checkpoint_path": str(root / "ckpt"), "num_epochs": 15,
        "batch_size": 50, "num_batch_negs": 10, "num_uniform_negs": 10, "lr": 0.1, "eval_fraction": 0.1,
        "workers": 1, "seed": 2, "init_scale": 0.1, "device": TEST_DEVICE,
    }


def test_featurized_entities_train_as_the_mean_of_their_features(tmp_path: Path) -> None:
    raw = write_featurized_graph(tmp_path)
    config = parse_config(raw)
    train(config)
    losses = pass_losses(config.checkpoint_path)
    assert losses[-1] < losses[0] * 0.8, losses
    storage = CheckpointStorage(config.checkpoint_path)
    features, state = storage.load_entity_partition(storage.load_version(), "user", 0)
    assert features.shape == (30, 16)  # one row per feature, not per entity
    assert float(state["state"][0]["sum"].sum()) > 0  # the feature rows were optimised
    metrics = evaluate(config)  # auto: PBG's protocol, the one that ranks bags of features
    assert metrics["count"] == 600 and 0 < metrics["mrr"] <= 1 and metrics["protocol"] == "pbg"
    from job.errors import UserError

    for candidates in ("all", "sampled"):
        with pytest.raises(UserError, match="featurized"):
            evaluate(config, candidates=candidates)


def test_featurized_batches_use_the_mean_of_feature_rows() -> None:
    from job.train.batch.batching import select_features

    offsets = torch.tensor([0, 2, 3, 6])
    data = torch.tensor([4, 5, 6, 7, 8, 9])
    picked_offsets, picked_data = select_features((offsets, data), torch.tensor([2, 0]))
    assert picked_offsets.tolist() == [0, 3, 5]
    assert picked_data.tolist() == [7, 8, 9, 4, 5]
    window_offsets, window_data = select_features((offsets, data), torch.tensor([1, 2]))
    assert window_offsets.tolist() == [0, 1, 4] and window_data.tolist() == [6, 7, 8, 9]
