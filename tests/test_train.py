"""Training: every operator/comparator/loss learns, bucket orders, partition swapping, resume, eval metrics."""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
import torch

from job.config import BucketOrder, parse_config
from job.evaluation import evaluate
from job.formats.checkpoint import CheckpointStorage
from job.formats.edges import edges_file, write_edges
from job.formats.entities import write_dynamic_rel_count, write_entity_count
from job.model.comparators import Comparator
from job.model.losses import compute_loss
from job.model.operators import Operator
from job.train import Trainer, train
from job.train.buckets import (
    Bucket,
    all_buckets,
    lower_bound_loads,
    order_buckets,
    swaps_needed,
)

sys.path.insert(0, str(Path(__file__).parent))
from helpers_graphs import line_graph, save_line_checkpoint  # noqa: E402

# BIGGRAPH_TEST_DEVICE=cuda trains the graphs of these tests on the GPU (tests/test_cuda.py: the CUDA-only tests)
TEST_DEVICE = os.environ.get("BIGGRAPH_TEST_DEVICE", "auto")


def write_cycle_graph(root: Path, num_entities: int = 40, num_partitions: int = 1, num_relations: int = 2,
                      dynamic: bool = False, **config: Any) -> dict[str, Any]:
    """A learnable graph: relation r links entity i to i + r + 1 (mod n); spread over partitions at random."""
    rng = np.random.default_rng(0)
    part_of = rng.integers(0, num_partitions, num_entities)
    offset_of = np.zeros(num_entities, dtype=np.int64)
    counts = [0] * num_partitions
    for entity in range(num_entities):
        offset_of[entity] = counts[part_of[entity]]
        counts[part_of[entity]] += 1
    entity_path = root / "entities"
    edge_path = root / "edges"
    for part, count in enumerate(counts):
        write_entity_count(str(entity_path), "node", part, count)
    if dynamic:
        write_dynamic_rel_count(str(entity_path), num_relations)
    heads = np.repeat(np.arange(num_entities), num_relations)
    rels = np.tile(np.arange(num_relations), num_entities)
    tails = (heads + rels + 1) % num_entities
    for lhs_part in range(num_partitions):
        for rhs_part in range(num_partitions):
            sel = (part_of[heads] == lhs_part) & (part_of[tails] == rhs_part)
            write_edges(edges_file(str(edge_path), lhs_part, rhs_part), rels[sel], offset_of[heads[sel]], offset_of[tails[sel]])
    relations = [{"name": "all", "lhs": "node", "rhs": "node", "operator": "translation"}] if dynamic else [
        {"name": f"r{r}", "lhs": "node", "rhs": "node", "operator": "translation"} for r in range(num_relations)
    ]
    raw: dict[str, Any] = {
        "entities": {"node": {"num_partitions": num_partitions}},
        "relations": relations,
        "dynamic_relations": dynamic,
        "global_emb": not dynamic,
        "dimension": 16,
        "entity_path": str(entity_path),
        "edge_paths": [str(edge_path)],
        "checkpoint_path": str(root / "checkpoints"),
        "num_epochs": 10,
        "batch_size": 20,
        "num_batch_negs": 10,
        "num_uniform_negs": 10,
        "lr": 0.1,
        "eval_fraction": 0.0,
        "workers": 1,
        "seed": 3,
        "init_scale": 0.1,
        "hogwild_delay": 0,
        "device": TEST_DEVICE,
    }
    raw.update(config)
    return raw


def assert_same_run(a: np.ndarray, b: np.ndarray) -> None:
    """Two runs that must compute the same: bit for bit on the CPU; on a GPU up to the order of its atomic
    additions (index_add_ sums a row's gradients in whatever order the threads arrive)."""
    if TEST_DEVICE == "cuda":
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    else:
        np.testing.assert_array_equal(a, b)


def pass_losses(checkpoint_path: str) -> list[float]:
    stats = CheckpointStorage(checkpoint_path).load_stats()
    return [s["stats"]["metrics"]["loss"] for s in stats if s.get("pass_summary")]


# model pieces ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["none", "diagonal", "translation", "linear", "affine", "complex_diagonal"])
@pytest.mark.parametrize("dynamic", [False, True])
def test_operator_shapes_gradients_and_identity_at_init(kind: str, dynamic: bool) -> None:
    operator = Operator(kind, 8, num_operations=3 if dynamic else 0)
    x = torch.randn(5, 8, requires_grad=True)
    rel = torch.tensor([0, 1, 2, 0, 1]) if dynamic else None
    y = operator(x, rel)
    assert y.shape == x.shape
    # PBG initialises every operator to the identity (complex_diagonal: 1 + 0i)
    assert torch.allclose(y, x)
    y.pow(2).sum().backward()
    assert torch.isfinite(x.grad).all()
    for param in operator.parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all()


@pytest.mark.parametrize("kind", ["dot", "cos", "l2", "squared_l2"])
@pytest.mark.parametrize("bias", [False, True])
def test_comparator_pairwise_matches_elementwise(kind: str, bias: bool) -> None:
    comparator = Comparator(kind, bias)
    x = comparator.prepare(torch.randn(2, 3, 6))
    y = comparator.prepare(torch.randn(2, 4, 6))
    pairwise = comparator.pairwise(x, y)
    assert pairwise.shape == (2, 3, 4)
    for c in range(2):
        for i in range(3):
            for j in range(4):
                expected = comparator.pos(x[c, i], y[c, j])
                assert torch.allclose(pairwise[c, i, j], expected, atol=1e-4), (c, i, j)


def test_cos_comparator_scores_are_cosines() -> None:
    comparator = Comparator("cos", False)
    x = comparator.prepare(torch.tensor([[3.0, 4.0]]))
    y = comparator.prepare(torch.tensor([[6.0, 8.0]]))
    assert torch.allclose(comparator.pos(x, y), torch.tensor([1.0]))


def test_losses_match_hand_computed_values() -> None:
    pos = torch.tensor([1.0, 0.0])
    neg = torch.tensor([[0.5, 1.5], [-1.0, 0.0]])
    # ranking: sum(max(0, margin - pos + neg))
    assert compute_loss("ranking", 0.1, pos, neg).item() == pytest.approx((0.0 + 0.6) + (0.0 + 0.1))
    # softmax: sum(logsumexp([pos, negs]) - pos)
    expected = sum(float(torch.logsumexp(torch.cat((pos[i:i + 1], neg[i])), 0) - pos[i]) for i in range(2))
    assert compute_loss("softmax", 0.1, pos, neg).item() == pytest.approx(expected, rel=1e-6)
    # logistic: BCE(pos, 1) + mean over negatives of BCE(neg, 0), summed over rows
    sig = torch.nn.functional.softplus
    expected = float(sig(-pos).sum() + sig(neg).sum() / 2)
    assert compute_loss("logistic", 0.1, pos, neg).item() == pytest.approx(expected, rel=1e-6)


# learning ---------------------------------------------------------------------------------------------


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


# buckets ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("order", list(BucketOrder))
@pytest.mark.parametrize("shape", [(1, 1), (4, 4), (3, 1), (1, 3), (5, 5)])
def test_every_bucket_exactly_once(order: BucketOrder, shape: tuple[int, int]) -> None:
    for seed in range(5):
        buckets = order_buckets(*shape, order, random.Random(seed))
        assert sorted(buckets) == sorted(all_buckets(*shape))


def test_inside_out_and_outside_in_layers() -> None:
    for seed in range(5):
        inside_out = order_buckets(5, 5, BucketOrder.INSIDE_OUT, random.Random(seed))
        layers = [min(b) for b in inside_out]
        assert layers == sorted(layers, reverse=True)
        outside_in = order_buckets(5, 5, BucketOrder.OUTSIDE_IN, random.Random(seed))
        layers = [min(b) for b in outside_in]
        assert layers == sorted(layers)
        # a bucket and its transpose are adjacent
        for i, bucket in enumerate(outside_in):
            if bucket.lhs != bucket.rhs:
                neighbours = outside_in[max(0, i - 1):i + 2]
                assert Bucket(bucket.rhs, bucket.lhs) in neighbours


def test_affinity_needs_fewer_swaps_than_random() -> None:
    affinity = sum(swaps_needed(order_buckets(8, 8, BucketOrder.AFFINITY, random.Random(s))) for s in range(10))
    rand = sum(swaps_needed(order_buckets(8, 8, BucketOrder.RANDOM, random.Random(s))) for s in range(10))
    assert affinity < rand
    for seed in range(5):
        order = order_buckets(6, 6, BucketOrder.AFFINITY, random.Random(seed))
        shared = sum(1 for a, b in zip(order, order[1:]) if {a.lhs, a.rhs} & {b.lhs, b.rhs})
        assert shared >= 0.8 * (len(order) - 1)  # nearly every step keeps a partition


def test_local_scheduler_walks_its_order_offers_the_rest_for_prefetch_and_keeps_every_record() -> None:
    from job.train.schedule import LocalScheduler

    order = [Bucket(0, 0), Bucket(1, 0), Bucket(0, 1), Bucket(1, 1)]
    scheduler = LocalScheduler(lambda rng: list(order), lambda b: {("n", b.lhs), ("n", b.rhs)})
    scheduler.start_pass(0, 1, 0)
    trained: list[Bucket] = []
    record = None
    while (bucket := scheduler.next_bucket(record)) is not None:
        following, needs = scheduler.upcoming()
        assert list(following) == order[len(trained) + 1:]
        assert list(needs) == [{("n", b.lhs), ("n", b.rhs)} for b in following]
        trained.append(bucket)
        record = {"bucket": list(bucket)}
    assert trained == order
    gathered = scheduler.gather({})
    assert gathered is not None and [r["bucket"] for r in gathered.records] == [list(b) for b in order]
    assert (gathered.world_size, gathered.buckets_redone, gathered.others_io) == (1, 0, [])


def test_a_single_process_run_writes_the_stats_shape_of_a_distributed_one(tmp_path: Path) -> None:
    from test_distributed import PASS_SUMMARY_KEYS

    raw = write_cycle_graph(tmp_path, num_entities=80, num_partitions=2, num_epochs=1, eval_fraction=0.2)
    train(parse_config(raw))
    records = CheckpointStorage(raw["checkpoint_path"]).load_stats()
    buckets = [r for r in records if "lhs_partition" in r]
    (summary,) = [r for r in records if r.get("pass_summary")]
    assert {r["rank"] for r in buckets} == {0}
    assert set(summary) - {"partition_loads_lower_bound"} == PASS_SUMMARY_KEYS | {"eval_stats_after"}
    assert (summary["world_size"], summary["restart_count"], summary["buckets_redone"]) == (1, 0, 0)
    assert summary["buckets_trained"] == len(buckets) == 4
    evaluated = [r["eval_stats_after"] for r in buckets]
    assert summary["eval_stats_after"]["count"] == sum(e["count"] for e in evaluated)
    mrr = sum(e["metrics"]["mrr"] * e["count"] for e in evaluated) / sum(e["count"] for e in evaluated)
    assert summary["eval_stats_after"]["metrics"]["mrr"] == pytest.approx(mrr)


def test_buffer_run_reports_its_partition_traffic(tmp_path: Path) -> None:
    raw = write_cycle_graph(tmp_path, num_entities=90, num_partitions=6, num_epochs=2, bucket_order="buffer",
                            partition_buffer=3)
    train(parse_config(raw))
    summaries = [s for s in CheckpointStorage(raw["checkpoint_path"]).load_stats() if s.get("pass_summary")]
    assert len(summaries) == 2
    first = summaries[0]
    # the buffer order takes the fewest loads there are on this grid (tests/test_bucket_order.py)
    assert first["partition_loads"] == first["partition_loads_lower_bound"] == lower_bound_loads(6, 3) == 9
    # the first pass initialises each partition on first use; it reads back only those it evicted and needs again
    assert first["partition_reads"] == first["partition_loads"] - 6
    assert first["partition_writes"] >= 6 and first["bytes_written"] > 0
    second = summaries[1]  # starts with 3 partitions in memory, reads the rest of the committed version
    assert second["partition_reads"] == second["partition_loads"] > 0
    assert second["partition_loads"] == second["partition_loads_lower_bound"] == lower_bound_loads(6, 3, resident=3) == 6
    assert second["io_blocked_seconds"] >= 0 and second["commit_seconds"] > 0


# partitions, checkpoints, resume -------------------------------------------------------------------------


@pytest.mark.parametrize("buffer,prefetch", [(2, False), (3, True), (4, True)])
def test_partitioned_training_stays_within_its_buffer_and_writes_every_partition(
    tmp_path: Path, monkeypatch, buffer: int, prefetch: bool
) -> None:
    raw = write_cycle_graph(tmp_path, num_entities=60, num_partitions=4, num_epochs=2, bucket_order="affinity",
                            partition_buffer=buffer, prefetch_partitions=prefetch)
    config = parse_config(raw)
    trainer = Trainer(config)
    resident: list[int] = []
    store = trainer.store
    original_hold, original_prepare = store.hold, store.prepare

    def held() -> int:  # in memory or being read into it (a write-back frees its slot before the read starts)
        return len(store.loaded) + len(store.pending)

    def spy_hold(keys: set, upcoming=()):
        evicted = original_hold(keys, upcoming)
        resident.append(held())
        return evicted

    def spy_prepare(*args):
        original_prepare(*args)
        resident.append(held())

    monkeypatch.setattr(store, "hold", spy_hold)
    monkeypatch.setattr(store, "prepare", spy_prepare)
    try:
        trainer.run()
    finally:
        trainer.close()
    assert len(resident) >= 2 * 16  # every bucket of both epochs
    assert max(resident) <= buffer
    if prefetch:
        assert store.prefetched_reads > 0  # the pipeline did read ahead
    stats = CheckpointStorage(config.checkpoint_path).load_stats()
    per_epoch = {}
    for record in stats:
        if "lhs_partition" in record:
            per_epoch.setdefault(record["epoch_idx"], []).append((record["lhs_partition"], record["rhs_partition"]))
    assert {e: sorted(b) for e, b in per_epoch.items()} == {e: sorted(all_buckets(4, 4)) for e in (0, 1)}
    storage = CheckpointStorage(config.checkpoint_path)
    assert storage.load_version() == 2
    names = sorted(p.name for p in Path(config.checkpoint_path).iterdir())
    assert names == sorted(
        [f"embeddings_node_{p}.v2.h5" for p in range(4)] + ["model.v2.h5", "checkpoint_version.txt", "config.json",
                                                             "training_stats.json", "checksums.v2.json"]
    )


def test_resume_gives_the_same_result_as_an_uninterrupted_run(tmp_path: Path) -> None:
    straight = write_cycle_graph(tmp_path / "a", num_partitions=2, num_epochs=4)
    train(parse_config(straight))
    resumed = write_cycle_graph(tmp_path / "b", num_partitions=2, num_epochs=4)
    config = parse_config(resumed)
    train(config, stop_after_iterations=2)
    assert CheckpointStorage(config.checkpoint_path).load_version() == 2
    train(config)  # a new process would do exactly this: read version 2 and go on
    a = CheckpointStorage(straight["checkpoint_path"])
    b = CheckpointStorage(resumed["checkpoint_path"])
    assert a.load_version() == b.load_version() == 4
    for part in range(2):
        emb_a, state_a = a.load_entity_partition(4, "node", part)
        emb_b, state_b = b.load_entity_partition(4, "node", part)
        assert_same_run(emb_a, emb_b)
        torch.testing.assert_close(state_a["state"][0]["sum"], state_b["state"][0]["sum"])
    params_a, _, _ = a.load_model(4)
    params_b, _, _ = b.load_model(4)
    assert params_a.keys() == params_b.keys()
    for name in params_a:
        assert_same_run(params_a[name], params_b[name])


def test_prefetching_partitions_changes_nothing_but_when_they_are_read(tmp_path: Path) -> None:
    runs = {}
    for prefetch in (False, True):
        raw = write_cycle_graph(tmp_path / str(prefetch), num_partitions=4, num_epochs=3, prefetch_partitions=prefetch,
                                bucket_order="random")
        config = parse_config(raw)
        trainer = Trainer(config)
        try:
            trainer.run()
            runs[prefetch] = trainer.store.prefetched_reads
        finally:
            trainer.close()
    assert runs[False] == 0 and runs[True] > 0, runs
    a = CheckpointStorage(str(tmp_path / "False" / "checkpoints"))
    b = CheckpointStorage(str(tmp_path / "True" / "checkpoints"))
    for part in range(4):
        emb_a, state_a = a.load_entity_partition(3, "node", part)
        emb_b, state_b = b.load_entity_partition(3, "node", part)
        assert_same_run(emb_a, emb_b)
        torch.testing.assert_close(state_a["state"][0]["sum"], state_b["state"][0]["sum"])


def test_a_failed_prefetch_fails_the_run_when_its_partition_is_needed(tmp_path: Path, monkeypatch) -> None:
    from job.train.partitions import PartitionStore

    raw = write_cycle_graph(tmp_path, num_partitions=3, num_epochs=1, prefetch_partitions=True)
    read = PartitionStore._read

    def failing_read(self, key):
        import threading

        if threading.current_thread().name.startswith("biggraph-prefetch"):
            raise OSError(f"simulated read failure of {key}")
        return read(self, key)

    monkeypatch.setattr(PartitionStore, "_read", failing_read)
    with pytest.raises(OSError, match="simulated read failure"):
        train(parse_config(raw))
    assert CheckpointStorage(raw["checkpoint_path"]).load_version() == 0  # nothing committed, nothing half-written


def test_uncommitted_leftovers_are_dropped_on_resume(tmp_path: Path) -> None:
    raw = write_cycle_graph(tmp_path, num_epochs=2)
    config = parse_config(raw)
    train(config, stop_after_iterations=1)
    # a crash while writing version 2: half a file exists, the marker still says 1
    (Path(config.checkpoint_path) / "embeddings_node_0.v2.h5").write_bytes(b"\x89HDF\r\n\x1a\n garbage")
    train(config)
    assert CheckpointStorage(config.checkpoint_path).load_version() == 2
    with h5py.File(Path(config.checkpoint_path) / "embeddings_node_0.v2.h5") as handle:
        assert handle["embeddings"].shape == (40, 16)


def test_checkpoint_layout_and_metadata_follow_pbg(tmp_path: Path) -> None:
    raw = write_cycle_graph(tmp_path, num_epochs=1)
    config = parse_config(raw)
    train(config)
    root = Path(config.checkpoint_path)
    assert (root / "checkpoint_version.txt").read_text().strip() == "1"
    assert json.loads((root / "config.json").read_text())["dimension"] == 16
    with h5py.File(root / "model.v1.h5") as handle:
        assert handle.attrs["format_version"] == 1
        assert json.loads(handle.attrs["config/json"])["relations"][0]["name"] == "r0"
        assert handle.attrs["iteration/epoch_idx"] == 0
        names: list[str] = []
        handle["model"].visit(names.append)
        assert "relations/0/operator/rhs/translation" in names
        assert "entities/node/global_embedding" in names
        assert handle["model/relations/1/operator/rhs/translation"].attrs["state_dict_key"] == "rhs_operators.1.translation"
        assert "optimizer/state_dict" in handle
    with h5py.File(root / "embeddings_node_0.v1.h5") as handle:
        assert handle["embeddings"].shape == (40, 16)
        assert handle["embeddings"].dtype == np.float32


def test_preservation_interval_keeps_epoch_snapshots(tmp_path: Path) -> None:
    raw = write_cycle_graph(tmp_path, num_epochs=4, checkpoint_preservation_interval=2)
    config = parse_config(raw)
    train(config)
    root = Path(config.checkpoint_path)
    for epoch, version in ((1, 2), (3, 4)):
        snapshot = CheckpointStorage(str(root / f"epoch_{epoch}"))
        assert snapshot.load_version() == version
        embeddings, _ = snapshot.load_entity_partition(version, "node", 0)
        assert embeddings.shape == (40, 16)
    assert not (root / "model.v3.h5").exists()


def test_init_path_starts_from_given_embeddings(tmp_path: Path) -> None:
    first = write_cycle_graph(tmp_path / "first", num_epochs=3)
    train(parse_config(first))
    second = write_cycle_graph(tmp_path / "second", num_epochs=1, init_path=first["checkpoint_path"], lr=1e-9)
    train(parse_config(second))
    a, _ = CheckpointStorage(first["checkpoint_path"]).load_entity_partition(3, "node", 0)
    b, _ = CheckpointStorage(second["checkpoint_path"]).load_entity_partition(1, "node", 0)
    np.testing.assert_allclose(a, b, atol=1e-5)


def test_seeded_single_worker_runs_are_reproducible(tmp_path: Path) -> None:
    for name in ("a", "b"):
        train(parse_config(write_cycle_graph(tmp_path / name, num_epochs=2)))
    a, _ = CheckpointStorage(str(tmp_path / "a" / "checkpoints")).load_entity_partition(2, "node", 0)
    b, _ = CheckpointStorage(str(tmp_path / "b" / "checkpoints")).load_entity_partition(2, "node", 0)
    assert_same_run(a, b)


def test_asking_for_a_missing_gpu_is_a_clean_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; the error case cannot happen")
    from job.cli import main

    raw = write_cycle_graph(tmp_path, num_gpus=1, device="auto")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    code = main(["train", str(path)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "CUDA is not available" in err and "num_gpus=1" in err


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


# eval metrics against a hand-computed case ----------------------------------------------------------------


def test_eval_metrics_match_hand_computed_ranks(tmp_path: Path) -> None:
    """Three entities on a line, dot comparator, no operator: ranks can be worked out by hand."""
    config = parse_config(line_graph(tmp_path))
    edge_path = config.edge_paths[0]
    save_line_checkpoint(config.checkpoint_path)
    metrics = evaluate(config, candidates="all")
    # edge (0 -> 1), score 1*2 = 2.
    #   corrupt rhs: candidates 0 (1*1=1), 2 (1*3=3): one scores >= 2 -> rank 2
    #   corrupt lhs: candidates 1 (2*2=4), 2 (3*2=6): both >= 2 -> rank 3
    # edge (1 -> 2), score 2*3 = 6.
    #   corrupt rhs: 0 (2), 1 (4): none >= 6 -> rank 1
    #   corrupt lhs: 0 (1*3=3), 2 (3*3=9): one -> rank 2
    ranks = [2, 3, 1, 2]
    assert metrics["count"] == 2
    assert metrics["mean_rank"] == pytest.approx(np.mean(ranks))
    assert metrics["mrr"] == pytest.approx(np.mean([1 / r for r in ranks]))
    assert metrics["hits@1"] == pytest.approx(0.25)
    assert metrics["hits@10"] == pytest.approx(1.0)
    # AUC: fraction of the 2 candidates below the positive, per rank: 1/2, 0, 1, 1/2
    assert metrics["auc"] == pytest.approx(np.mean([0.5, 0.0, 1.0, 0.5]))
    # filtered: removing the true edge (1 -> 2) from the candidates of edge (0 -> 1)'s lhs side...
    filtered = evaluate(config, filter_paths=[edge_path], candidates="all")
    # edge (0->1) corrupt lhs: candidate 1 would form (1 -> 1)? not a true edge; candidate 2: (2 -> 1) no.
    # edge (1->2) corrupt lhs: candidate 0 forms (0 -> 2)? no. corrupt rhs of (0->1): candidate 2 forms (0->2)? no.
    # edge (1->2) corrupt rhs: candidate 1 forms (1 -> 1)? no. So nothing is filtered here:
    assert filtered["mrr"] == pytest.approx(metrics["mrr"])
    # now add (0 -> 2) as a known edge: it filters candidate 2 for (0 -> 1)'s rhs side (rank 2 -> 1)
    # and candidate 0 for (1 -> 2)'s lhs side (which scored below the positive: rank stays 2)
    known = tmp_path / "known"
    write_edges(edges_file(str(known), 0, 0), np.array([0]), np.array([0]), np.array([2]))
    filtered = evaluate(config, filter_paths=[edge_path, str(known)], candidates="all")
    assert filtered["mean_rank"] == pytest.approx(np.mean([1, 3, 1, 2]))


# featurized entities -----------------------------------------------------------------------------------


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
    from job.train.batching import select_features

    offsets = torch.tensor([0, 2, 3, 6])
    data = torch.tensor([4, 5, 6, 7, 8, 9])
    picked_offsets, picked_data = select_features((offsets, data), torch.tensor([2, 0]))
    assert picked_offsets.tolist() == [0, 3, 5]
    assert picked_data.tolist() == [7, 8, 9, 4, 5]
    window_offsets, window_data = select_features((offsets, data), torch.tensor([1, 2]))
    assert window_offsets.tolist() == [0, 1, 4] and window_data.tolist() == [6, 7, 8, 9]


@pytest.mark.parametrize("loss_fn", ["ranking", "logistic", "softmax"])
def test_weighted_uniform_negatives_equal_the_materialised_ones(tmp_path: Path, loss_fn: str) -> None:
    """Few candidates, many samples: scoring each candidate once with its draw count must give PBG's sums."""
    from job.model.scoring import Model
    from job.train.step import BatchStats, _add_ranks

    config = parse_config(write_cycle_graph(tmp_path, loss_fn=loss_fn, comparator="dot"))
    model = Model(config)
    generator = torch.Generator().manual_seed(0)
    anchor = torch.randn(7, 16, generator=generator)
    positives = torch.randn(7, 16, generator=generator)
    candidates = torch.randn(5, 16, generator=generator)
    neg_inv = torch.randint(0, 5, (2, 9), generator=generator)  # 2 chunks of 4, 9 draws each > 5 candidates
    with torch.no_grad():  # the scoring used by evaluation; training's fused twin is held to it in test_fused.py
        weighted = model._side_scores(anchor, positives, candidates, neg_inv, torch.arange(7), 4, False, False)
    assert weighted.weight is not None  # the counted path was taken
    # the same negatives, one column per draw, as PBG lays them out
    padded_anchor = torch.cat((anchor, torch.zeros(1, 16))).view(2, 4, 16)
    padded_pos = torch.cat((positives, torch.zeros(1, 16))).view(2, 4, 16)
    batch = padded_anchor @ padded_pos.transpose(1, 2)
    mask = torch.eye(4, dtype=torch.bool).expand(2, 4, 4).clone()
    mask[-1, :, 3:] = True
    batch = batch.masked_fill(mask, -1e9)
    uniform = padded_anchor @ candidates[neg_inv].transpose(1, 2)
    explicit = torch.cat((batch, uniform), dim=2).reshape(8, -1)[:7]
    expected = compute_loss(loss_fn, 0.1, weighted.pos, explicit)
    got = compute_loss(loss_fn, 0.1, weighted.pos, weighted.neg, weighted.weight, weighted.num_neg)
    assert got.item() == pytest.approx(expected.item(), rel=1e-5)
    from job.model.scoring import SideScores

    ranks_weighted, ranks_explicit = BatchStats(), BatchStats()
    _add_ranks(ranks_weighted, weighted)
    _add_ranks(ranks_explicit, SideScores(weighted.pos, explicit))
    assert ranks_weighted.rank_sum == pytest.approx(ranks_explicit.rank_sum)
    assert ranks_weighted.auc_sum == pytest.approx(ranks_explicit.auc_sum)


def test_train_starts_one_process_per_gpu_only_when_asked_and_present() -> None:
    from job.train.launch import gpu_processes

    assert gpu_processes(4, "auto", 8, False) == 4
    assert gpu_processes(8, "auto", 2, False) == 2  # no more processes than cards
    assert gpu_processes(4, "auto", 0, False) == 1  # no card: the trainer's clean "CUDA is not available" error
    assert gpu_processes(4, "auto", 4, True) == 1  # under torchrun the launcher chose the processes
    assert gpu_processes(4, "cpu", 4, False) == 1
    assert gpu_processes(1, "cuda", 4, False) == 1


def test_gpu_processes_need_two_partitions_each() -> None:
    from job.train.launch import partition_advice

    raw = {"entities": {"node": {"num_partitions": 4}}, "relations": [{"name": "r", "lhs": "node", "rhs": "node"}],
           "dimension": 4, "entity_path": "x", "edge_paths": ["x"], "checkpoint_path": "x"}
    assert partition_advice(parse_config(raw), 2) == ""
    assert "num_partitions >= 6" in partition_advice(parse_config(raw), 3)
    raw["entities"]["node"]["num_partitions"] = 1
    assert "some GPUs will wait" in partition_advice(parse_config(raw), 2)
