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


def _run_trainer(raw: dict) -> Trainer:
    """Train ``raw`` to the end with a ``Trainer`` kept for inspection (its store, its graphs)."""
    trainer = Trainer(parse_config(raw))
    try:
        trainer.run()
    finally:
        trainer.close()
    return trainer


def test_graphs_are_captured_in_the_first_pass_and_replayed_in_every_later_one(tmp_path: Path) -> None:
    """P=4 on one card: every partition stays on it (the card's memory is the buffer), so each relation's graph is
    captured once per (lhs, rhs) pair of tables and replayed in every later bucket and pass, and computes what the
    eager steps compute."""
    from job.train.batch.graphs import GraphedSteps

    captures, results = [], []
    for epochs in (1, 3):
        GraphedSteps.captures = GraphedSteps.replays = 0
        raw = _complex_graph(tmp_path / f"e{epochs}", num_entities=800, num_partitions=4, num_epochs=epochs,
                             device="cuda")
        trainer = _run_trainer(raw)
        # the last pass loaded nothing: all four stayed on the card since the first
        assert trainer.store.capacity == 4 and trainer.store.stats.loads == (4 if epochs == 1 else 0)
        captures.append(GraphedSteps.captures)
        assert GraphedSteps.disabled_reason is None
    # a graph per (relation, lhs table, rhs table) at most, whatever the passes (per-bucket graphs captured them
    # again in every pass: ~3x the first pass's); a key whose first pass had too few full batches to be captured
    # may be captured in a later one
    assert 0 < captures[0] <= captures[1] <= 2 * 16 and captures[1] < 2 * captures[0], captures
    assert GraphedSteps.replays > 0
    raw = _complex_graph(tmp_path / "eager", num_entities=800, num_partitions=4, num_epochs=3, device="cuda",
                         cuda_graphs=False)
    train(parse_config(raw))
    for part in range(4):
        results = [CheckpointStorage(str(tmp_path / name / "checkpoints")).load_entity_partition(3, "node", part)[0]
                   for name in ("e3", "eager")]
        np.testing.assert_allclose(results[0], results[1], rtol=1e-4, atol=1e-5)
    # the replays' statistics, added up inside the graphs, are the eager steps' (the pass losses of the log)
    replayed, eager = (pass_losses(str(tmp_path / name / "checkpoints")) for name in ("e3", "eager"))
    np.testing.assert_allclose(replayed, eager, rtol=1e-4)


def test_swaps_through_the_side_stream_compute_what_the_cpu_computes(tmp_path: Path) -> None:
    """A buffer of three partitions for P=4 swaps every few buckets: the next bucket's partition is read and
    uploaded in the I/O thread on the store's side stream, the one leaving is downloaded there after the event of
    the bucket that let it go. The result is the CPU trainer's with the same buffer, up to float rounding."""
    results = {}
    for device in ("cpu", "cuda"):
        raw = _complex_graph(tmp_path / device, num_entities=400, num_partitions=4, num_epochs=3, device=device,
                             partition_buffer=3)
        trainer = _run_trainer(raw)
        if device == "cuda":
            assert trainer.store.capacity == 3
            assert trainer.store.gpu is not None
            assert trainer.store.gpu.uploads > 0 and trainer.store.gpu.downloads > 0
            assert trainer.store.prefetched_reads > 0
        storage = CheckpointStorage(raw["checkpoint_path"])
        results[device] = [storage.load_entity_partition(3, "node", part)[0] for part in range(4)]
    for cpu, cuda in zip(results["cpu"], results["cuda"]):
        assert np.abs(cpu).max() > 0.05
        np.testing.assert_allclose(cuda, cpu, rtol=1e-3, atol=1e-4)


def test_large_partitions_are_drawn_and_large_buckets_shuffled_on_the_card(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Above the thresholds (lowered here) a fresh partition is drawn by the card's generator and a bucket shuffled
    there: a seeded run is the same twice, trains, and its initial rows are N(0, init_scale²)."""
    from job.train import bucket_run
    from job.train.residency import reads

    monkeypatch.setattr(reads, "DEVICE_INIT_VALUES", 1)
    monkeypatch.setattr(bucket_run, "DEVICE_SHUFFLE_EDGES", 1)
    runs = []
    for name in ("a", "b"):
        raw = _complex_graph(tmp_path / name, num_entities=2000, num_partitions=2, num_epochs=2, device="cuda")
        train(parse_config(raw))
        storage = CheckpointStorage(raw["checkpoint_path"])
        runs.append([storage.load_entity_partition(2, "node", part)[0] for part in range(2)])
        losses = pass_losses(raw["checkpoint_path"])
        assert losses[-1] < losses[0], losses
    for a, b in zip(*runs):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    from job.train.batch.graphs import GraphedSteps

    assert GraphedSteps.disabled_reason is None  # every capture held (a failed one leaves torch's RNG unusable)
    raw = _complex_graph(tmp_path / "init", num_entities=20000, num_partitions=2, num_epochs=1, device="cuda",
                         lr=1e-9)  # (a rate of 0 is refused): rows that training leaves as they were drawn
    train(parse_config(raw))
    rows = CheckpointStorage(raw["checkpoint_path"]).load_entity_partition(1, "node", 0)[0]
    assert abs(float(rows.std()) - 0.1) < 0.005 and abs(float(rows.mean())) < 0.005


def test_device_copies_order_the_side_stream_after_the_training_stream() -> None:
    """A download after ``mark`` sees what the training stream wrote before it, however long that took; an upload is
    ready on the training stream once ``ready`` returns, without the host waiting for it."""
    from job.train.residency.device_copies import DeviceCopies

    copies = DeviceCopies(torch.device("cuda", torch.cuda.current_device()))
    big = torch.randn(4096, 4096, device="cuda")
    table = torch.zeros(1000, 16, device="cuda")
    for _ in range(20):  # queue work that takes a while before the write the download must see
        big = big @ big / 64
    table.add_(1.0)
    after = copies.mark()
    host = copies.to_host(table, after)
    assert float(host.sum()) == 16_000.0
    uploaded = copies.upload(torch.full((500, 8), 2.0), torch.ones(500))
    weight, sums = copies.ready(uploaded)
    assert float((weight * 2).sum()) == 16_000.0 and float(sums.sum()) == 500.0
    assert copies.uploads == 1 and copies.downloads == 1
