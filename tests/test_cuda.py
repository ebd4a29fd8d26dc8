"""CUDA: the GPU trainer computes what the CPU trainer computes, and trains one process per GPU.

These need a GPU. On a machine with one, the training suites also run on it:
``BIGGRAPH_TEST_DEVICE=cuda pytest tests/test_train_*.py tests/test_fused.py tests/test_cuda.py``
(every operator/comparator/loss, resume, featurized entities, the fused path against autograd).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers_graphs import pass_losses, write_cycle_graph

from job.config import parse_config
from job.formats.checkpoint import CheckpointStorage
from job.train import Trainer, train

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (none on this machine)")


def _complex_graph(root: Path, num_entities: int = 60, **config: object) -> dict:
    raw = write_cycle_graph(root, num_entities=num_entities, **config)
    for relation in raw["relations"]:
        relation["operator"] = "complex_diagonal"
    return raw


def test_a_seeded_cuda_run_matches_the_cpu_run(tmp_path: Path) -> None:
    """Same seed, same negatives (drawn on the CPU for both): only float rounding may differ."""
    results = []
    for device in ("cpu", "cuda"):
        raw = _complex_graph(tmp_path / device, num_partitions=2, num_epochs=3, device=device)
        train(parse_config(raw))
        storage = CheckpointStorage(raw["checkpoint_path"])
        assert storage.load_version() == 3
        results.append([storage.load_entity_partition(3, "node", part)[0] for part in range(2)])
    for cpu, cuda in zip(*results):
        assert np.abs(cpu).max() > 0.05  # trained, not the initial 0.1-scaled noise left alone
        np.testing.assert_allclose(cuda, cpu, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("dynamic", [False, True])
def test_cuda_graphs_replay_the_same_steps(tmp_path: Path, dynamic: bool) -> None:
    from job.train.batch.graphs import GraphedSteps

    results, replays = [], []
    for graphs in (False, True):
        GraphedSteps.replays = 0
        raw = _complex_graph(tmp_path / str(graphs), num_epochs=4, device="cuda", cuda_graphs=graphs, dynamic=dynamic,
                             max_norm=2.0)
        train(parse_config(raw))
        storage = CheckpointStorage(raw["checkpoint_path"])
        results.append(storage.load_entity_partition(4, "node", 0)[0])
        replays.append(GraphedSteps.replays)
        assert GraphedSteps.disabled_reason is None
    assert replays[0] == 0 and replays[1] > 0, replays
    np.testing.assert_allclose(results[1], results[0], rtol=1e-4, atol=1e-5)


def _two_type_graph(root: Path, comparator: str, cuda_graphs: bool) -> dict:
    """Tables of very different sizes in one bucket: the batch code's cached scratch arrays grow between
    the captures of different relations (a graph must keep what it captured alive)."""
    from job.formats.edges import edges_file, write_edges
    from job.formats.entities import write_entity_count

    rng = np.random.default_rng(1)
    sizes = {"small": 40, "big": 3000}
    for name, size in sizes.items():
        write_entity_count(str(root / "entities"), name, 0, size)
    pairs = [("small", "small"), ("big", "big"), ("small", "big")]
    rel = np.repeat(np.arange(3), 100)
    lhs = np.concatenate([rng.integers(0, sizes[a], 100) for a, _ in pairs])
    rhs = np.concatenate([rng.integers(0, sizes[b], 100) for _, b in pairs])
    write_edges(edges_file(str(root / "edges"), 0, 0), rel, lhs, rhs)
    return {
        "entities": {name: {"num_partitions": 1} for name in sizes},
        "relations": [{"name": f"r{i}", "lhs": a, "rhs": b, "operator": "complex_diagonal"} for i, (a, b) in enumerate(pairs)],
        "dimension": 16, "entity_path": str(root / "entities"), "edge_paths": [str(root / "edges")],
        "checkpoint_path": str(root / "checkpoints"), "num_epochs": 3, "batch_size": 20, "num_batch_negs": 10,
        "num_uniform_negs": 10, "lr": 0.1, "eval_fraction": 0.0, "workers": 1, "seed": 5, "init_scale": 0.1,
        "comparator": comparator, "device": "cuda", "cuda_graphs": cuda_graphs,
    }


@pytest.mark.parametrize("comparator", ["dot", "l2"])
def test_cuda_graphs_with_tables_of_different_sizes(tmp_path: Path, comparator: str) -> None:
    from job.train.batch.graphs import GraphedSteps

    results = []
    for graphs in (False, True):
        GraphedSteps.replays = 0
        raw = _two_type_graph(tmp_path / str(graphs), comparator, graphs)
        train(parse_config(raw))
        storage = CheckpointStorage(raw["checkpoint_path"])
        results.append([storage.load_entity_partition(3, name, 0)[0] for name in ("small", "big")])
        assert (GraphedSteps.replays > 0) == graphs
        assert GraphedSteps.disabled_reason is None
    for eager, replayed in zip(*results):
        np.testing.assert_allclose(replayed, eager, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dynamic", [False, True])
def test_eval_on_the_gpu_gives_the_cpu_metrics(tmp_path: Path, dynamic: bool) -> None:
    """All-candidate ranks are the same numbers. Sampled ones are compared where a negative is rarely the
    positive entity itself: such a tie holds only up to each device's rounding, and ties count against a
    rank. (With dynamic relations the edges are batched in file order, where an entity's other edge is in
    the same chunk: its own row is then always among the batch negatives, so only the static case.)"""
    from job.evaluation import evaluate

    cases = {"all": _complex_graph(tmp_path / "all", num_epochs=3, device="cpu", dynamic=dynamic)}
    if not dynamic:
        cases["sampled"] = _complex_graph(tmp_path / "sampled", num_entities=2000, num_epochs=2, device="cpu",
                                          eval_num_uniform_negs=50, eval_num_batch_negs=50)
    for candidates, raw in cases.items():
        train(parse_config(raw))
        filters = [raw["edge_paths"][0]] if candidates == "all" else []
        cpu, cuda = (evaluate(parse_config({**raw, "device": device}), filter_paths=filters,
                                      candidates=candidates) for device in ("cpu", "cuda"))
        assert cpu["count"] == cuda["count"] > 0
        for key in ("mrr", "hits@1", "hits@10", "hits@50", "auc", "mean_rank"):
            assert cuda[key] == pytest.approx(cpu[key], rel=1e-4 if candidates == "all" else 0.02, abs=1e-6), \
                (candidates, key)


def test_num_gpus_selects_the_gpu_and_each_local_rank_its_card(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trainer = Trainer(parse_config(write_cycle_graph(tmp_path, num_gpus=1, device="auto")))
    try:
        assert trainer.device.type == "cuda"
        assert trainer.workers == 1  # Hogwild processes are a CPU scheme
    finally:
        trainer.close()
    from job.train.inputs import pick_device

    cards = torch.cuda.device_count()
    monkeypatch.setenv("LOCAL_RANK", str(cards + 1))
    assert pick_device(parse_config(write_cycle_graph(tmp_path / "b", device="cuda"))) == torch.device("cuda", 1 % cards)


def test_num_gpus_2_trains_one_process_per_gpu(tmp_path: Path) -> None:
    """``biggraph train`` with num_gpus=2 starts a torchrun group of two trainers sharing the buckets, from warm spares.

    The parent is made to see two cards; the two children then share however many the machine has
    (LOCAL_RANK modulo the card count), so this runs on a one-GPU machine too.
    """
    raw = _complex_graph(tmp_path, num_partitions=4, num_epochs=3, num_gpus=2, device="auto", workers=1)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    script = ("import sys, torch; torch.cuda.device_count = lambda: 2; from job.cli import main; "
              f"sys.exit(main(['train', {str(path)!r}]))")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert "one per GPU" in output
    # the relaunch goes through the pods' launcher: both trainers came from warm spares, whose imports ran before
    # any CUDA call (job/train/elastic/spare.py), and then each took its card
    startups = [line for line in output.splitlines() if "start-up: first bucket trained" in line]
    assert len(startups) == 2 and all("a warm spare" in line for line in startups), startups
    storage = CheckpointStorage(raw["checkpoint_path"])
    assert {record.get("rank") for record in storage.load_stats() if "lhs_partition" in record} == {0, 1}
    assert storage.load_version() == 3
    for part in range(4):
        embeddings, _ = storage.load_entity_partition(3, "node", part)
        assert np.isfinite(embeddings).all()
    losses = pass_losses(raw["checkpoint_path"])
    assert losses and losses[-1] < losses[0], losses
